//! The tree of cached KV blocks: each cached block's parent is the cached block before it on its
//! prefix (block 0, the null block, is the root of every chain), and each block may carry the Mamba
//! checkpoint that holds the state after its last token.
//!
//! The block hashes already chain prefixes, but hashes only answer "is this exact prefix cached".
//! Eviction needs the shape: which checkpoint a hit would fall back to if a checkpoint went (its
//! nearest checkpoint above, for the FLOPs it saves), which checkpoints lie directly below a new one
//! (they now fall back to it), and whether a block can still serve any hit at all (a hybrid hit
//! needs a checkpoint at or beyond every KV block it uses: `below[b] > 0`).
//!
//! Intrusive arrays indexed by block id: parent, first child, siblings, the attached checkpoint and
//! the number of checkpoints in the block's subtree (itself included). Walks are bounded by the
//! depth of a prefix in blocks.

use crate::mamba_pool::SlotId;

/// Not in the tree.
const NIL: u32 = u32::MAX;
/// The root: block 0 (the null block) is never cached, so its id names the root.
pub const ROOT: u32 = 0;

#[derive(Debug, Clone)]
pub struct PrefixTree {
    parent: Vec<u32>,
    first_child: Vec<u32>,
    next_sib: Vec<u32>,
    prev_sib: Vec<u32>,
    ckpt: Vec<SlotId>,
    below: Vec<u32>,
}

impl PrefixTree {
    pub fn new(num_blocks: usize) -> Self {
        PrefixTree {
            parent: vec![NIL; num_blocks],
            first_child: vec![NIL; num_blocks],
            next_sib: vec![NIL; num_blocks],
            prev_sib: vec![NIL; num_blocks],
            ckpt: vec![0; num_blocks],
            below: vec![0; num_blocks],
        }
    }

    /// Whether `b` is in the tree (a cached block).
    #[inline]
    pub fn is_linked(&self, b: u32) -> bool {
        self.parent.get(b as usize).is_some_and(|&p| p != NIL)
    }

    /// The parent of a linked block (ROOT for the first block of a chain).
    pub fn parent(&self, b: u32) -> Option<u32> {
        self.parent.get(b as usize).copied().filter(|&p| p != NIL)
    }

    #[inline]
    pub fn has_children(&self, b: u32) -> bool {
        self.first_child[b as usize] != NIL
    }

    /// Checkpoints attached in the subtree of `b`, `b` included.
    #[inline]
    pub fn below(&self, b: u32) -> u32 {
        self.below[b as usize]
    }

    /// The checkpoint attached to `b` (0 = none).
    #[inline]
    pub fn checkpoint(&self, b: u32) -> SlotId {
        self.ckpt[b as usize]
    }

    /// Links `b` (not linked) under `parent` (ROOT or a linked block).
    pub fn link(&mut self, b: u32, parent: u32) {
        debug_assert!(!self.is_linked(b) && b != ROOT);
        debug_assert!(parent == ROOT || self.is_linked(parent));
        let first = self.first_child[parent as usize];
        self.parent[b as usize] = parent;
        self.prev_sib[b as usize] = NIL;
        self.next_sib[b as usize] = first;
        if first != NIL {
            self.prev_sib[first as usize] = b;
        }
        self.first_child[parent as usize] = b;
    }

    /// Unlinks a linked leaf without a checkpoint.
    pub fn unlink_leaf(&mut self, b: u32) {
        debug_assert!(self.is_linked(b) && !self.has_children(b));
        debug_assert_eq!(self.ckpt[b as usize], 0);
        let (p, n) = (self.prev_sib[b as usize], self.next_sib[b as usize]);
        if p != NIL {
            self.next_sib[p as usize] = n;
        } else {
            self.first_child[self.parent[b as usize] as usize] = n;
        }
        if n != NIL {
            self.prev_sib[n as usize] = p;
        }
        self.parent[b as usize] = NIL;
        self.prev_sib[b as usize] = NIL;
        self.next_sib[b as usize] = NIL;
    }

    /// The linked blocks of the subtree of `b`, `b` included, children before their parent (the
    /// order in which they can be unlinked as leaves).
    pub fn subtree_post_order(&self, b: u32, out: &mut Vec<u32>) {
        // Iterative: chains can be thousands of blocks deep.
        let start = out.len();
        let mut stack = vec![b];
        while let Some(x) = stack.pop() {
            out.push(x);
            let mut c = self.first_child[x as usize];
            while c != NIL {
                stack.push(c);
                c = self.next_sib[c as usize];
            }
        }
        // Pre-order with every child after its parent; reversed, every child comes first.
        out[start..].reverse();
    }

    /// Attaches checkpoint `slot` to the linked block `b` (which has none). Blocks whose subtree
    /// count goes from 0 to 1 (they become useful again) are appended to `became_useful`.
    pub fn attach(&mut self, b: u32, slot: SlotId, became_useful: &mut Vec<u32>) {
        debug_assert!(self.is_linked(b) && self.ckpt[b as usize] == 0 && slot != 0);
        self.ckpt[b as usize] = slot;
        let mut x = b;
        while x != ROOT && x != NIL {
            self.below[x as usize] += 1;
            if self.below[x as usize] == 1 {
                became_useful.push(x);
            }
            x = self.parent[x as usize];
        }
    }

    /// Detaches the checkpoint of `b` (returns it, 0 if none). Blocks whose subtree count drops to 0
    /// (no hit can use them any more) are appended to `became_useless`.
    pub fn detach(&mut self, b: u32, became_useless: &mut Vec<u32>) -> SlotId {
        let slot = self.ckpt[b as usize];
        if slot == 0 {
            return 0;
        }
        self.ckpt[b as usize] = 0;
        let mut x = b;
        while x != ROOT && x != NIL {
            self.below[x as usize] -= 1;
            if self.below[x as usize] == 0 {
                became_useless.push(x);
            }
            x = self.parent[x as usize];
        }
        slot
    }

    /// The checkpoint nearest above `b` on its prefix (excluding `b` itself), if any.
    pub fn nearest_checkpoint_above(&self, b: u32) -> Option<SlotId> {
        let mut x = self.parent(b)?;
        while x != ROOT {
            let s = self.ckpt[x as usize];
            if s != 0 {
                return Some(s);
            }
            x = self.parent[x as usize];
        }
        None
    }

    /// The checkpoints directly below `b` (in its subtree, excluding `b`, with no other checkpoint
    /// between them and `b`). Visits only branches that hold a checkpoint.
    pub fn checkpoints_directly_below(&self, b: u32, out: &mut Vec<SlotId>) {
        let mut stack = Vec::new();
        let mut c = self.first_child[b as usize];
        while c != NIL {
            stack.push(c);
            c = self.next_sib[c as usize];
        }
        while let Some(x) = stack.pop() {
            if self.below[x as usize] == 0 {
                continue;
            }
            let s = self.ckpt[x as usize];
            if s != 0 {
                out.push(s);
                continue;
            }
            let mut c = self.first_child[x as usize];
            while c != NIL {
                stack.push(c);
                c = self.next_sib[c as usize];
            }
        }
    }

    /// Forgets everything (every block unlinked, no checkpoint).
    pub fn clear(&mut self) {
        self.parent.fill(NIL);
        self.first_child.fill(NIL);
        self.next_sib.fill(NIL);
        self.prev_sib.fill(NIL);
        self.ckpt.fill(0);
        self.below.fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// root -> 1 -> 2 -> 3, 2 -> 4, root -> 5
    fn tree() -> PrefixTree {
        let mut t = PrefixTree::new(8);
        t.link(1, ROOT);
        t.link(2, 1);
        t.link(3, 2);
        t.link(4, 2);
        t.link(5, ROOT);
        t
    }

    #[test]
    fn counts_and_usefulness_transitions() {
        let mut t = tree();
        let mut v = Vec::new();
        t.attach(3, 30, &mut v);
        assert_eq!(v, vec![3, 2, 1]);
        v.clear();
        t.attach(4, 40, &mut v);
        assert_eq!(v, vec![4]);
        assert_eq!((t.below(1), t.below(2), t.below(3)), (2, 2, 1));
        v.clear();
        assert_eq!(t.detach(3, &mut v), 30);
        assert_eq!(v, vec![3]);
        v.clear();
        assert_eq!(t.detach(4, &mut v), 40);
        assert_eq!(v, vec![4, 2, 1]);
        assert_eq!(t.detach(4, &mut v), 0, "nothing attached");
    }

    #[test]
    fn nearest_above_and_directly_below() {
        let mut t = tree();
        let mut v = Vec::new();
        t.attach(1, 10, &mut v);
        t.attach(3, 30, &mut v);
        t.attach(4, 40, &mut v);
        assert_eq!(t.nearest_checkpoint_above(3), Some(10));
        assert_eq!(t.nearest_checkpoint_above(1), None);
        let mut below = Vec::new();
        t.checkpoints_directly_below(1, &mut below);
        below.sort_unstable();
        assert_eq!(below, vec![30, 40]);
        // A checkpoint at 2 now sits between 1 and {3, 4}.
        t.attach(2, 20, &mut v);
        below.clear();
        t.checkpoints_directly_below(1, &mut below);
        assert_eq!(below, vec![20]);
        assert_eq!(t.nearest_checkpoint_above(4), Some(20));
    }

    #[test]
    fn post_order_unlinks_as_leaves() {
        let mut t = tree();
        let mut order = Vec::new();
        t.subtree_post_order(1, &mut order);
        assert_eq!(order.len(), 4);
        assert_eq!(*order.last().unwrap(), 1);
        for b in order {
            t.unlink_leaf(b);
        }
        assert!(!t.is_linked(1) && t.is_linked(5));
        assert_eq!(t.parent(5), Some(ROOT));
    }
}
