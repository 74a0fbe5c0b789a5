//! Scheduler tests. `Sim` plays the runner and the model: it executes every output the way the
//! runner must (state copies in order, then the forward), keeps a fingerprint of the KV cache and
//! of every Mamba state slot, and checks on each row that the KV of the computed prefix and the
//! initial state are exactly those of the request's accepted tokens. Its "model" is greedy and
//! deterministic in the token prefix, so every request has one true output whatever the batching,
//! chunking, caching, speculation or preemption.

use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::config::{CheckpointPlacement, EvictionPolicy, MambaCacheMode, ResolvedConfig};
use crate::request::{FinishReason, NewRequest};

fn ids(o: &SchedulerOutput) -> Vec<&str> {
    o.req_ids.iter().map(|s| &**s).collect()
}

const H0: u64 = 0x1234_5678_9abc_def0;

fn roll(h: u64, t: u32) -> u64 {
    (h ^ (t as u64).wrapping_add(0x9E37_79B9))
        .wrapping_mul(0x0100_0000_01B3)
        .rotate_left(23)
}

fn mix(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x
}

fn next_tok(vocab: u32, h: u64) -> u32 {
    (mix(h ^ 0xabcdef) % vocab as u64) as u32 + 1
}

fn prefix_hash(tokens: &[u32]) -> u64 {
    tokens.iter().fold(H0, |h, &t| roll(h, t))
}

/// Small deterministic PRNG.
#[derive(Clone, Debug)]
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        mix(self.0)
    }
    fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            0
        } else {
            (self.next() % n as u64) as usize
        }
    }
}

#[derive(Clone, Debug)]
struct SimReq {
    prompt: Vec<u32>,
    out: Vec<u32>,
    max_tokens: usize,
    eos: Option<u32>,
    finished: Option<FinishReason>,
    /// Prefix hashes of prompt + out: ph[i] = hash of the first i tokens.
    ph: Vec<u64>,
    last_end: usize,
    residency: u32,
    drafts: Vec<u32>,
    steps_waited: usize,
}

impl SimReq {
    fn seq(&self) -> Vec<u32> {
        let mut s = self.prompt.clone();
        s.extend(&self.out);
        s
    }
    fn push(&mut self, t: u32) {
        let h = roll(*self.ph.last().unwrap(), t);
        self.ph.push(h);
        self.out.push(t);
    }
}

struct Sim {
    s: Scheduler,
    cfg: ResolvedConfig,
    vocab: u32,
    kv: HashMap<i64, u64>,
    slots: HashMap<i64, (u64, usize)>,
    reqs: HashMap<String, SimReq>,
    rng: Rng,
    /// Probability (per 8) that a draft is correct.
    draft_quality: usize,
    steps: usize,
    max_wait: usize,
    emits: usize,
    publishes_seen: usize,
    kv_copies: usize,
    /// Every row: (request, computed before, tokens, emitted token indices).
    row_log: Vec<(String, usize, usize, Vec<usize>)>,
    /// Admissions that started from a hit, and those that started inside a block (tail hits).
    hits: usize,
    tail_hits: usize,
    /// Steps planned ahead and confirmed, and their rows whose request had ended meanwhile.
    planned_steps: usize,
    dead_rows: usize,
    /// Plan each step ahead while the one before runs where the scheduler can.
    plan_ahead: bool,
    next: Option<SchedulerOutput>,
}

impl Sim {
    fn new(cfg: ResolvedConfig, blocks: usize, slots: usize, seed: u64) -> Self {
        Sim {
            s: Scheduler::new(&cfg, blocks, slots, 7).unwrap(),
            cfg,
            vocab: 50,
            kv: HashMap::new(),
            slots: HashMap::new(),
            reqs: HashMap::new(),
            rng: Rng(seed),
            draft_quality: 6,
            steps: 0,
            max_wait: 0,
            emits: 0,
            publishes_seen: 0,
            kv_copies: 0,
            row_log: Vec::new(),
            hits: 0,
            tail_hits: 0,
            planned_steps: 0,
            dead_rows: 0,
            plan_ahead: false,
            next: None,
        }
    }

    fn next_token(&self, h: u64) -> u32 {
        next_tok(self.vocab, h)
    }

    fn add(&mut self, id: &str, prompt: Vec<u32>, max_tokens: usize, eos: Option<u32>) {
        self.add_prio(id, prompt, max_tokens, eos, 0, None);
    }

    fn add_prio(
        &mut self,
        id: &str,
        prompt: Vec<u32>,
        max_tokens: usize,
        eos: Option<u32>,
        priority: i64,
        shared_prefix_len: Option<usize>,
    ) {
        let mut nr = NewRequest::new(id, prompt.clone(), max_tokens);
        nr.stop.eos_token_id = eos;
        nr.priority = priority;
        nr.shared_prefix_len = shared_prefix_len;
        self.s.add_request(nr).unwrap();
        let mut ph = vec![H0];
        for &t in &prompt {
            ph.push(roll(*ph.last().unwrap(), t));
        }
        self.reqs.insert(
            id.to_string(),
            SimReq {
                prompt,
                out: Vec::new(),
                max_tokens,
                eos,
                finished: None,
                ph,
                last_end: 0,
                residency: 0,
                drafts: Vec::new(),
                steps_waited: 0,
            },
        );
    }

    fn abort(&mut self, id: &str) {
        if self.s.abort_request(id) {
            if let Some(r) = self.reqs.get_mut(id) {
                r.finished = Some(FinishReason::Abort);
            }
        }
    }

    /// The greedy output of a prompt under this model.
    fn expected_output(&self, r: &SimReq) -> Vec<u32> {
        let mut seq = r.prompt.clone();
        let mut h = prefix_hash(&seq);
        let mut out = Vec::new();
        while out.len() < r.max_tokens && seq.len() < self.cfg.max_model_len {
            let t = self.next_token(h);
            out.push(t);
            seq.push(t);
            h = roll(h, t);
            if Some(t) == r.eos {
                break;
            }
        }
        out
    }

    /// One schedule + forward + update. Returns the number of rows.
    fn step(&mut self) -> usize {
        let o = match self.next.take() {
            Some(planned) => planned,
            None => self.s.schedule().unwrap(),
        };
        let (rows, next) = self.run(o, self.plan_ahead);
        self.next = next;
        rows
    }

    /// The forward and update of `o`; with `ahead`, the next step is planned (`schedule_ahead`)
    /// while `o` "runs", confirmed after its update and returned with its patch applied.
    fn run(&mut self, o: SchedulerOutput, ahead: bool) -> (usize, Option<SchedulerOutput>) {
        if o.rows.is_empty() {
            for r in self.reqs.values_mut().filter(|r| r.finished.is_none()) {
                r.steps_waited += 1;
            }
            return (0, None);
        }
        self.steps += 1;
        let vocab = self.vocab;
        let b = self.cfg.block_size as i64;
        let m = self.cfg.mamba_block_size;
        let w = o.window_len;
        assert_eq!(
            *o.query_start_loc.last().unwrap() as usize,
            o.num_scheduled_tokens
        );
        assert!(o.num_scheduled_tokens <= self.cfg.max_num_batched_tokens);
        assert!(o.rows.len() <= self.cfg.max_num_seqs);
        assert!(o.rows[..o.num_decodes].iter().all(|r| r.is_decode));
        assert!(o.rows[o.num_decodes..].iter().all(|r| !r.is_decode));
        // Copies first, in order.
        for (src, dst) in o.copies() {
            let v = *self
                .slots
                .get(&src)
                .expect("copy from a slot never written");
            assert_ne!(dst, 0);
            self.slots.insert(dst, v);
        }
        if o.num_copies() > 0 {
            self.publishes_seen += o.num_copies();
        }
        // KV block copies (tail hits): the whole block, before the forward.
        let bs = self.cfg.block_size as i64;
        for c in o.kv_copies.chunks_exact(2) {
            let (src, dst) = (c[0], c[1]);
            assert!(src > 0 && dst > 0 && src != dst);
            for off in 0..bs {
                match self.kv.get(&(src * bs + off)).copied() {
                    Some(v) => self.kv.insert(dst * bs + off, v),
                    None => self.kv.remove(&(dst * bs + off)),
                };
            }
            self.kv_copies += 1;
        }
        let grid_only = !self.cfg.checkpoint_placement.branch();
        let mut sampled: Vec<i32> = Vec::new();
        let mut num_sampled: Vec<i32> = Vec::new();
        let mut drafts: Vec<i32> = Vec::new();
        let mut num_drafts: Vec<i32> = Vec::new();
        let mut seen = std::collections::HashSet::new();
        let mut emits_by_row: HashMap<usize, Vec<(usize, i64)>> = HashMap::new();
        for e in 0..o.num_emits() {
            emits_by_row
                .entry(o.emit_row[e] as usize)
                .or_default()
                .push((o.emit_token[e] as usize, o.emit_slot[e]));
        }
        let mut scheduled_ids = std::collections::HashSet::new();
        for (r, row) in o.rows.iter().enumerate() {
            let id = o.req_ids[r].to_string();
            assert!(seen.insert(id.clone()), "request twice in a batch");
            if self.s.get_request(&id).is_none() {
                // A row planned ahead whose request ended before it ran: it writes nothing
                // that is read (KV into the null block, states into the null slot).
                // (A request aborted while the step runs has its row computed as planned, as in
                // any step: nothing is allocated before that step's update.)
                let ended = self.reqs[&id].finished;
                assert!(ahead && ended.is_some(), "{id}: a row of no request");
                if ended != Some(FinishReason::Abort) {
                    assert!(o.slot_mapping[o.row_range(r)].iter().all(|&x| x < b));
                    assert!(o.write_slots_row(r).iter().all(|&x| x == 0));
                }
                // what it writes is garbage to any reader
                for flat in o.row_range(r) {
                    self.kv.insert(o.slot_mapping[flat], 0xdead);
                }
                for &slot in o.write_slots_row(r).iter().filter(|&&x| x != 0) {
                    self.slots.insert(slot, (0xdead, 0));
                }
                num_sampled.push(0);
                num_drafts.push(0);
                self.dead_rows += 1;
                continue;
            }
            scheduled_ids.insert(id.clone());
            let residency = self.s.get_request(&id).unwrap().num_preemptions;
            let sr = self.reqs.get_mut(&id).unwrap();
            sr.steps_waited = 0;
            let seq = sr.seq();
            let nc = o.num_computed_tokens[r] as usize;
            let range = o.row_range(r);
            let n = range.len();
            assert_eq!(nc, row.num_computed_before);
            assert_eq!(n, row.num_new_tokens);
            // Exactly once per residency: a row continues where the last one ended, unless the
            // request was preempted (then it restarts from its prefix hit).
            if residency == sr.residency && sr.last_end > 0 {
                assert_eq!(nc, sr.last_end, "request {id} skipped or recomputed tokens");
            } else {
                if grid_only || !self.s.checkpoints {
                    assert_eq!(
                        nc % self.cfg.block_size,
                        0,
                        "a hit is a whole number of blocks"
                    );
                }
                if self.s.checkpoints && nc > 0 && grid_only {
                    assert_eq!(nc % m, 0, "a hybrid hit ends on a checkpoint");
                }
                if nc > 0 {
                    self.hits += 1;
                    if nc % self.cfg.block_size != 0 {
                        self.tail_hits += 1;
                    }
                }
                assert!(nc < seq.len());
                sr.residency = residency;
            }
            assert!(nc + n <= seq.len() + row.num_drafts);
            // The KV of the computed prefix is exactly that of the accepted tokens.
            let table = o.block_table_row(r);
            for q in 0..nc {
                let phys = table[q / self.cfg.block_size] * b + (q as i64 % b);
                assert_eq!(
                    self.kv.get(&phys),
                    Some(&sr.ph[q + 1]),
                    "{id}: KV at {q} is wrong"
                );
            }
            // Initial state.
            let mamba = self.cfg.has_mamba_layers;
            let mut st = if o.has_initial_state[r] && !mamba {
                (sr.ph[nc], nc)
            } else if o.has_initial_state[r] {
                let v = *self
                    .slots
                    .get(&o.state_read_slot[r])
                    .expect("read from a slot never written");
                assert_eq!(
                    v,
                    (sr.ph[nc], nc),
                    "{id}: initial state is not the state after {nc} tokens"
                );
                v
            } else {
                assert_eq!(nc, 0);
                (H0, 0)
            };
            let ws = o.write_slots_row(r);
            let row_emits = emits_by_row.remove(&r).unwrap_or_default();
            self.row_log
                .push((id.clone(), nc, n, row_emits.iter().map(|e| e.0).collect()));
            if self.s.align && grid_only && !row.is_decode && nc + n < seq.len() {
                assert_eq!((nc + n) % m, 0, "align chunk ends off a boundary");
            }
            for (t, flat) in range.clone().enumerate() {
                let tok = o.input_ids[flat] as u32;
                let pos = nc + t;
                assert_eq!(o.positions[flat] as usize, pos);
                if row.is_decode && t > 0 {
                    assert_eq!(tok, sr.drafts[t - 1]);
                } else {
                    assert_eq!(tok, seq[pos], "{id}: wrong input token at {pos}");
                }
                st = (roll(st.0, tok), st.1 + 1);
                let phys = o.slot_mapping[flat];
                assert_eq!(phys, table[pos / self.cfg.block_size] * b + pos as i64 % b);
                assert!(phys >= b, "KV written to the null block");
                self.kv.insert(phys, st.0);
                if row.is_decode && mamba {
                    assert_ne!(ws[t], 0);
                    self.slots.insert(ws[t], st);
                }
                for &(et, es) in &row_emits {
                    if et == t {
                        if grid_only {
                            assert_eq!((pos + 1) % m, 0);
                        } else {
                            assert_eq!((pos + 1) % self.cfg.block_size, 0);
                        }
                        self.slots.insert(es, st);
                        self.emits += 1;
                    }
                }
            }
            if !mamba {
            } else if row.is_decode {
                assert!(ws[n..].iter().all(|&x| x == 0));
            } else {
                assert_ne!(ws[0], 0);
                assert!(ws[1..w].iter().all(|&x| x == 0));
                self.slots.insert(ws[0], st);
            }
            // Sampling.
            let nl = o.num_logits[r] as usize;
            let mut toks = Vec::new();
            if row.is_decode {
                assert_eq!(nl, n);
                // Greedy verification against the true continuation.
                let mut h = sr.ph[nc + 1];
                let mut i = 0;
                loop {
                    let y = next_tok(vocab, h);
                    toks.push(y);
                    if i < row.num_drafts && sr.drafts[i] == y {
                        h = roll(h, y);
                        i += 1;
                    } else {
                        break;
                    }
                }
            } else if nl == 1 {
                assert_eq!(nc + n, seq.len());
                toks.push(next_tok(vocab, st.0));
            } else {
                assert_eq!(nl, 0);
                assert!(nc + n < seq.len());
            }
            num_sampled.push(toks.len() as i32);
            sampled.extend(toks.iter().map(|&t| t as i32));
            // Drafts for the next step: a true prefix of the continuation, then wrong tokens.
            let k_max = self.cfg.num_speculative_tokens();
            let nd = self.rng.below(k_max + 1);
            let mut cont = seq.clone();
            cont.truncate(nc + 1);
            if row.is_decode {
                cont.truncate(seq.len());
            }
            let mut h = sr.ph[seq.len()];
            for &t in &toks {
                h = roll(h, t);
            }
            let mut d = Vec::new();
            let mut good = true;
            for _ in 0..nd {
                let y = next_tok(vocab, h);
                good = good && self.rng.below(8) < self.draft_quality;
                let t = if good { y } else { y % self.vocab + 1 };
                d.push(t as i32);
                h = roll(h, t);
            }
            num_drafts.push(nd as i32);
            drafts.extend(&d);
            sr.drafts = d.iter().map(|&x| x as u32).collect();
        }
        let before_ids: Vec<String> = o.req_ids.iter().map(|s| s.to_string()).collect();
        let planned = if ahead {
            self.s.schedule_ahead(&o).unwrap()
        } else {
            None
        };
        let deltas = self
            .s
            .update_from_output(&o, &sampled, &num_sampled, Some((&drafts, &num_drafts)))
            .unwrap();
        // Apply deltas: tokens must be the sampled ones, in order, cut at a stop.
        let mut off = 0;
        let mut per_row: HashMap<&str, &[i32]> = HashMap::new();
        for (r, id) in before_ids.iter().enumerate() {
            let n = num_sampled[r] as usize;
            per_row.insert(id.as_str(), &sampled[off..off + n]);
            off += n;
        }
        for d in &deltas {
            let sr = self.reqs.get_mut(&*d.request_id).unwrap();
            if let Some(s) = per_row.get(&*d.request_id) {
                assert!(d.new_token_ids.len() <= s.len());
                for (a, &b) in d.new_token_ids.iter().zip(s.iter()) {
                    assert_eq!(*a, b as u32);
                }
                if d.new_token_ids.len() < s.len() {
                    assert!(d.finished);
                }
            }
            for &t in &d.new_token_ids {
                sr.push(t);
            }
            if d.finished {
                sr.finished = d.finish_reason;
                if d.finish_reason == Some(FinishReason::Stop) {
                    assert_eq!(d.stop_token_id, sr.out.last().copied());
                    assert_eq!(sr.eos, d.stop_token_id);
                }
            }
        }
        for (r, row) in o.rows.iter().enumerate() {
            let id = &before_ids[r];
            if let Some(sr) = self.reqs.get_mut(id) {
                if sr.finished.is_none() {
                    let req = self.s.get_request(id).unwrap();
                    sr.last_end = req.num_computed_tokens;
                    assert_eq!(req.all_token_ids, sr.seq());
                    if row.is_decode {
                        assert_eq!(
                            sr.last_end,
                            row.num_computed_before + num_sampled[r] as usize
                        );
                    }
                }
            }
        }
        for (id, sr) in self.reqs.iter_mut() {
            if sr.finished.is_none() && !scheduled_ids.contains(id) {
                sr.steps_waited += 1;
                self.max_wait = self.max_wait.max(sr.steps_waited);
            }
        }
        let next = planned.and_then(|mut p| {
            let patch = self.s.confirm_ahead(&mut p).unwrap()?;
            patch.apply_to(&mut p).unwrap();
            self.planned_steps += 1;
            Some(p)
        });
        (o.rows.len(), next)
    }

    fn run_to_end(&mut self, max_steps: usize) {
        let mut idle = 0;
        for _ in 0..max_steps {
            if !self.s.has_unfinished_requests() {
                break;
            }
            if self.step() == 0 {
                idle += 1;
                assert!(idle < 3, "no progress although requests are unfinished");
            } else {
                idle = 0;
            }
        }
        assert!(!self.s.has_unfinished_requests(), "requests starved");
    }

    fn check_end(&self) {
        for (id, r) in &self.reqs {
            let exp = self.expected_output(r);
            match r.finished {
                Some(FinishReason::Abort) => assert!(exp.starts_with(&r.out), "{id}"),
                Some(_) => assert_eq!(r.out, exp, "{id}: output differs from the true one"),
                None => panic!("{id} unfinished"),
            }
        }
        let st = self.s.stats();
        assert_eq!(st.cache.kv_blocks_used, 0, "KV blocks leaked");
        assert_eq!(
            st.cache.mamba_slots_used,
            st.cache.checkpoints_committed + st.cache.checkpoints_pending,
            "state slots leaked"
        );
        assert_eq!(st.num_running, 0);
        assert_eq!(st.num_waiting, 0);
    }
}

fn cfg(mode: MambaCacheMode, k: usize) -> ResolvedConfig {
    ResolvedConfig::for_tests(mode, k)
}

/// `cfg` with the branch placement (branch points and last tokens) and an eviction policy.
fn cfg_branch(mode: MambaCacheMode, k: usize, eviction: EvictionPolicy) -> ResolvedConfig {
    let mut c = ResolvedConfig::for_tests(mode, k);
    c.checkpoint_placement = CheckpointPlacement::Branch;
    c.eviction = eviction;
    c
}

const CHECKPOINT_MODES: [MambaCacheMode; 2] = [MambaCacheMode::Align, MambaCacheMode::All];
const ALL_MODES: [MambaCacheMode; 3] = [
    MambaCacheMode::None,
    MambaCacheMode::Align,
    MambaCacheMode::All,
];

// ------------------------------------------------------------------ behaviours

#[test]
fn prefill_then_decode_with_positions_and_slots() {
    let mut sim = Sim::new(cfg(MambaCacheMode::None, 0), 64, 32, 1);
    sim.add("a", (1..=30).collect(), 5, None);
    sim.run_to_end(100);
    sim.check_end();
    assert_eq!(sim.steps, 5, "one prefill step and four decode steps");
}

#[test]
fn chunked_prefill_respects_budget_and_shares_steps_with_decodes() {
    let mut c = cfg(MambaCacheMode::None, 0);
    c.max_num_batched_tokens = 32;
    let mut s = Scheduler::new(&c, 128, 64, 0).unwrap();
    s.add_request(NewRequest::new("short", vec![1, 2, 3], 10))
        .unwrap();
    let o = s.schedule().unwrap();
    s.update_from_output(&o, &[5], &[1], None).unwrap();
    s.add_request(NewRequest::new("long", (1..=100).collect(), 1))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(ids(&o), vec!["short", "long"]);
    assert_eq!(o.num_decodes, 1);
    assert_eq!(o.num_scheduled_tokens, 32);
    assert_eq!(o.rows[1].num_new_tokens, 31);
    assert_eq!(o.num_logits, vec![1, 0]);
    s.update_from_output(&o, &[6], &[1, 0], None).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.num_computed_tokens, vec![4, 31]);
}

#[test]
fn chunked_prefill_off_schedules_whole_prompts_or_waits() {
    let mut c = cfg(MambaCacheMode::None, 0);
    c.enable_chunked_prefill = false;
    c.max_num_batched_tokens = 40;
    let mut s = Scheduler::new(&c, 128, 64, 0).unwrap();
    assert!(s
        .add_request(NewRequest::new("huge", vec![1; 41], 1))
        .is_err());
    s.add_request(NewRequest::new("a", vec![1; 30], 3)).unwrap();
    s.add_request(NewRequest::new("b", vec![2; 30], 3)).unwrap();
    s.add_request(NewRequest::new("c", vec![3; 30], 3)).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(
        ids(&o),
        vec!["a"],
        "b does not fit whole next to a and is not chunked"
    );
    s.update_from_output(&o, &[5], &[1], None).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(
        ids(&o),
        vec!["a", "b"],
        "1 decode + 30 fits; c (30 > 9 left) waits"
    );
    assert_eq!(o.rows[1].num_new_tokens, 30);
    s.update_from_output(&o, &[5, 6], &[1, 1], None).unwrap();
}

#[test]
fn a_prompt_that_finishes_its_prefill_in_a_step_goes_before_a_long_prefill_which_goes_first_next() {
    let mut c = cfg(MambaCacheMode::None, 0);
    c.max_num_batched_tokens = 32;
    let mut s = Scheduler::new(&c, 128, 64, 0).unwrap();
    s.add_request(NewRequest::new("long", (1..=200).collect(), 1))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(
        o.num_scheduled_tokens, 32,
        "alone, the long prefill takes the whole budget"
    );
    s.update_from_output(&o, &[], &[0], None).unwrap();
    s.add_request(NewRequest::new("s1", vec![7; 10], 3))
        .unwrap();
    s.add_request(NewRequest::new("s2", vec![8; 10], 3))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(ids(&o), vec!["long", "s1", "s2"]);
    let rows: Vec<usize> = o.rows.iter().map(|r| r.num_new_tokens).collect();
    assert_eq!(
        rows,
        vec![12, 10, 10],
        "the short prompts finish; the long one takes the rest"
    );
    s.update_from_output(&o, &[5, 6], &[0, 1, 1], None).unwrap();
    s.add_request(NewRequest::new("s3", vec![9; 25], 3))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(
        ids(&o),
        vec!["s1", "s2", "long"],
        "the prefill that gave way goes first: s3 waits a step"
    );
    assert_eq!(o.rows[2].num_new_tokens, 30);
    s.update_from_output(&o, &[5, 6], &[1, 1, 0], None).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(ids(&o), vec!["s1", "s2", "long", "s3"]);
    let rows: Vec<usize> = o.rows.iter().map(|r| r.num_new_tokens).collect();
    assert_eq!(rows, vec![1, 1, 5, 25]);

    // a running prefill that can finish in the step does not give way
    let mut s = Scheduler::new(&c, 128, 64, 0).unwrap();
    s.add_request(NewRequest::new("mid", (1..=57).collect(), 1))
        .unwrap();
    let o = s.schedule().unwrap();
    s.update_from_output(&o, &[], &[0], None).unwrap();
    s.add_request(NewRequest::new("s", vec![7; 20], 3)).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(ids(&o), vec!["mid", "s"]);
    let rows: Vec<usize> = o.rows.iter().map(|r| r.num_new_tokens).collect();
    assert_eq!(
        rows,
        vec![25, 7],
        "mid finishes; s starts in the tokens left"
    );
}

/// Runs single-token steps until every request decodes.
/// Updates step `o` with token 1 for every logit row (every draft accepted as 1).
fn update_with_ones(s: &mut Scheduler, o: &SchedulerOutput) {
    let ns = o.num_logits.clone();
    let total: i32 = ns.iter().sum();
    s.update_from_output(o, &vec![1; total as usize], &ns, None)
        .unwrap();
}

fn warm_decodes(s: &mut Scheduler, n: usize) {
    for i in 0..n {
        s.add_request(NewRequest::new(format!("d{i}"), vec![i as u32 + 1; 3], 50))
            .unwrap();
    }
    while s.running.len() < n || s.requests.values().any(|r| r.num_computed_tokens == 0) {
        let o = s.schedule().unwrap();
        update_with_ones(s, &o);
    }
}

#[test]
fn align_cuts_a_chunk_down_to_a_boundary() {
    let mut c = cfg(MambaCacheMode::Align, 0);
    c.max_num_batched_tokens = 16;
    let mut s = Scheduler::new(&c, 256, 64, 0).unwrap();
    warm_decodes(&mut s, 5);
    // Five decodes leave 11 tokens: a 40-token prompt advances by 8.
    s.add_request(NewRequest::new("p", vec![9; 40], 1)).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.num_decodes, 5);
    assert_eq!(
        o.rows[5].num_new_tokens, 8,
        "chunk cut down to the boundary"
    );
    assert_eq!(o.emit_token, vec![7]);
}

#[test]
fn align_defers_a_chunk_that_rounds_to_zero() {
    let mut c = cfg(MambaCacheMode::Align, 0);
    c.max_num_batched_tokens = 16;
    let mut s = Scheduler::new(&c, 256, 64, 0).unwrap();
    warm_decodes(&mut s, 9);
    // Nine decodes leave 7 < M tokens: the prefill is deferred, not spun on.
    s.add_request(NewRequest::new("p", vec![9; 40], 1)).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.num_decodes, 9);
    assert_eq!(o.rows.len(), 9);
    assert_eq!(o.num_scheduled_tokens, 9);
    assert_eq!(s.get_request("p").unwrap().status, RequestStatus::Waiting);
}

#[test]
fn a_running_align_prefill_that_decodes_leave_no_boundary_advances_in_its_next_step() {
    // A long prompt admitted alone, then a short request arriving every step: each becomes a
    // decode row, planned before the prefill, and soon the rows leave it less than M tokens (its
    // chunk rounds down to zero). Held back, it has M tokens kept from the decode rows in its next
    // step, so it advances at least every other step instead of waiting for the short requests
    // to stop.
    let mut c = cfg(MambaCacheMode::Align, 0);
    c.max_num_batched_tokens = 16;
    let m = c.mamba_block_size;
    let mut s = Scheduler::new(&c, 512, 128, 0).unwrap();
    s.add_request(NewRequest::new("p", vec![9; 120], 1))
        .unwrap();
    let mut computed = Vec::new();
    for step in 0..40 {
        s.add_request(NewRequest::new(
            format!("d{step}"),
            vec![step as u32 + 1; 2],
            200,
        ))
        .unwrap();
        let o = s.schedule().unwrap();
        update_with_ones(&mut s, &o);
        let Some(p) = s.get_request("p") else {
            break; // (its prefill done, its one token made)
        };
        computed.push(p.num_computed_tokens);
    }
    assert!(
        s.get_request("p").is_none(),
        "the long prefill starved: computed tokens by step {computed:?}"
    );
    for w in computed.windows(3) {
        assert!(w[2] >= w[0] + m, "no progress in two steps: {computed:?}");
    }
}

#[test]
fn a_prefill_held_back_keeps_only_what_advances_it_from_the_decode_rows() {
    // A long prompt beside short requests arriving in threes every other step: it advances at
    // least every other step, and in every step the decode rows run as many as the budget holds
    // beside the M tokens kept for it (never none of them).
    let mut c = cfg(MambaCacheMode::Align, 0);
    c.max_num_batched_tokens = 64;
    let m = c.mamba_block_size;
    let mut s = Scheduler::new(&c, 1024, 256, 0).unwrap();
    s.add_request(NewRequest::new("p", vec![9; 1000], 1))
        .unwrap();
    let mut computed = Vec::new();
    for step in 0..60u32 {
        if step % 2 == 0 {
            for j in 0..3 {
                let id = format!("d{step}-{j}");
                s.add_request(NewRequest::new(id, vec![step + j + 1; 19], 30))
                    .unwrap();
            }
        }
        let decoding = s
            .requests
            .values()
            .filter(|r| {
                r.status == RequestStatus::Running
                    && r.num_computed_tokens > 0
                    && r.num_computed_tokens + 1 >= r.num_tokens()
            })
            .count();
        let o = s.schedule().unwrap();
        assert!(
            o.num_decodes >= decoding.min(64 - m),
            "step {step}: {} of {decoding} decode rows ran",
            o.num_decodes
        );
        update_with_ones(&mut s, &o);
        match s.get_request("p") {
            Some(p) => computed.push(p.num_computed_tokens),
            None => break,
        }
    }
    for w in computed.windows(3) {
        assert!(w[2] > w[0], "no progress in two steps: {computed:?}");
    }
}

#[test]
fn align_prompt_tail_cut_at_last_boundary_and_emits() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::Align, 0), 256, 64, 0).unwrap();
    s.add_request(NewRequest::new("a", (1..=21).collect(), 1))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(
        o.rows[0].num_new_tokens, 16,
        "cut at the last boundary before 21"
    );
    assert_eq!(o.emit_row, vec![0]);
    assert_eq!(o.emit_token, vec![15]);
    let ck = o.emit_slot[0] as SlotId;
    assert_eq!(o.pending_checkpoints, vec![ck]);
    s.update_from_output(&o, &[], &[0], None).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.rows[0].num_new_tokens, 5);
    assert!(o.emit_row.is_empty());
    s.update_from_output(&o, &[3], &[1], None).unwrap();
    let tag = s.cache().debug_tag(ck);
    assert_eq!(tag.map(|t| t.1), Some(16));
}

#[test]
fn a_checkpoint_emitted_by_a_row_aborted_mid_step_is_dropped() {
    // The engine aborts a request between schedule() and update_from_output() when its row
    // failed: the state its row emitted must not become a checkpoint anyone can hit.
    let mut s = Scheduler::new(&cfg(MambaCacheMode::Align, 0), 256, 64, 0).unwrap();
    s.add_request(NewRequest::new("bad", (1..=21).collect(), 1))
        .unwrap();
    s.add_request(NewRequest::new("good", (101..=121).collect(), 1))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.emit_row.len(), 2, "both prompts emit at their boundary");
    let slot_of = |row: i64| {
        let i = o.emit_row.iter().position(|&r| r == row).unwrap();
        o.emit_slot[i] as SlotId
    };
    let bad_row = o.req_ids.iter().position(|id| &**id == "bad").unwrap() as i64;
    let (bad_ck, good_ck) = (slot_of(bad_row), slot_of(1 - bad_row));
    // the Python binding hands the emit arrays to the model (moves them out)
    let mut o = o;
    o.emit_row.clear();
    o.emit_slot.clear();
    assert!(s.abort_request("bad"));
    s.update_from_output(&o, &[], &[0, 0], None).unwrap();
    assert_eq!(s.cache().debug_tag(bad_ck), None, "dropped, not committed");
    assert_eq!(s.cache().debug_tag(good_ck).map(|t| t.1), Some(16));
    // the same prompt again finds no state of the aborted row
    s.add_request(NewRequest::new("again", (1..=21).collect(), 1))
        .unwrap();
    let o = s.schedule().unwrap();
    let r = o.req_ids.iter().position(|id| &**id == "again").unwrap();
    assert_eq!(o.rows[r].num_computed_before, 0);
}

#[test]
fn skip_prefix_hit_computes_the_whole_prompt_and_still_caches_it() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::Align, 0), 256, 64, 0).unwrap();
    let prompt: Vec<u32> = (1..=40).collect();
    let run = |s: &mut Scheduler, id: &str, skip: bool| -> usize {
        let mut req = NewRequest::new(id, [prompt.clone(), vec![7, 7]].concat(), 1);
        req.skip_prefix_hit = skip;
        s.add_request(req).unwrap();
        let mut first_start = None;
        while s.has_unfinished_requests() {
            let o = s.schedule().unwrap();
            let r = o.req_ids.iter().position(|x| &**x == id).unwrap();
            first_start.get_or_insert(o.rows[r].num_computed_before);
            let n = o.rows[r].num_logits as i32;
            let toks = vec![5; n as usize];
            s.update_from_output(&o, &toks, &[n], None).unwrap();
        }
        first_start.unwrap_or(0)
    };
    assert_eq!(run(&mut s, "first", false), 0);
    assert_eq!(
        run(&mut s, "scorer", true),
        0,
        "the whole prompt is computed"
    );
    assert_eq!(
        run(&mut s, "normal", false),
        40,
        "and the cache still serves others"
    );
}

#[test]
fn all_mode_emits_every_boundary_inside_a_chunk() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::All, 0), 256, 64, 0).unwrap();
    s.add_request(NewRequest::new("a", (1..=30).collect(), 1))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.rows[0].num_new_tokens, 30, "no alignment in all mode");
    assert_eq!(o.emit_token, vec![7, 15, 23]);
    assert_eq!(o.emit_row, vec![0, 0, 0]);
    let at24 = o.emit_slot[2];
    s.update_from_output(&o, &[3], &[1], None).unwrap();
    // Same prompt again: hit at 24 (a multiple of M, <= 29).
    s.add_request(NewRequest::new("b", (1..=30).collect(), 1))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.num_computed_tokens, vec![24]);
    assert_eq!(o.num_copies(), 1);
    assert_eq!(
        o.state_copies[0], at24,
        "the hit copies the checkpoint emitted at 24"
    );
    assert_eq!(o.state_copies[1], o.state_read_slot[0]);
}

/// A scheduler (K = 3) whose request "a" (prompt 1..=6, `max_tokens`) has been prefilled with
/// drafts 8, 9, 10 proposed, and its verify step scheduled: tokens 7 (position 6), 8, 9, 10.
fn at_first_verify_step(mode: MambaCacheMode, max_tokens: usize) -> (Scheduler, SchedulerOutput) {
    let mut s = Scheduler::new(&cfg(mode, 3), 256, 64, 0).unwrap();
    s.add_request(NewRequest::new("a", (1..=6).collect(), max_tokens))
        .unwrap();
    let o = s.schedule().unwrap();
    s.update_from_output(&o, &[7], &[1], Some((&[8, 9, 10], &[3])))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.input_ids, vec![7, 8, 9, 10]);
    (s, o)
}

#[test]
fn decode_crossing_a_boundary_publishes_the_exact_window_slot() {
    // Prompt 6 tokens, K = 3: decode rows at 6.. cross 8.
    let (mut s, o) = at_first_verify_step(MambaCacheMode::Align, 50);
    let window: Vec<i64> = o.write_slots_row(0).to_vec();
    // Accept 2 drafts + correction: computed 6 -> 9 crosses 8: state after 8 = window[8 - 6 - 1].
    s.update_from_output(&o, &[8, 9, 11], &[3], Some((&[], &[0])))
        .unwrap();
    assert_eq!(s.pending_publishes.len(), 1);
    let (src, dst) = s.pending_publishes[0];
    assert_eq!(src as i64, window[1]);
    assert_eq!(s.cache().debug_tag(dst).map(|t| t.1), Some(8));
    let o = s.schedule().unwrap();
    assert_eq!(
        o.state_copies[..2],
        [window[1], dst as i64],
        "publish first, next step"
    );
    assert_eq!(o.pending_checkpoints, vec![dst]);
    assert_eq!(
        o.state_read_slot,
        vec![window[2]],
        "live state = window[a - 1]"
    );
    s.update_from_output(&o, &[12], &[1], None).unwrap();
    assert_eq!(s.cache().stats().checkpoints_pending, 0);
}

#[test]
fn a_request_ended_after_a_publishing_update_keeps_the_window_slot_itself() {
    // A stop string (finish_request) or an abort between the update that reached a boundary and
    // the next step: the checkpoint is kept on the window slot at once, nothing stays pending
    // while the engine is idle, and the next prompt through that boundary hits it.
    for finish in [true, false] {
        let (mut s, o) = at_first_verify_step(MambaCacheMode::Align, 50);
        let window: Vec<i64> = o.write_slots_row(0).to_vec();
        s.update_from_output(&o, &[8, 9, 11], &[3], Some((&[], &[0])))
            .unwrap();
        let (src, dst) = s.pending_publishes[0];
        assert!(if finish {
            s.finish_request("a")
        } else {
            s.abort_request("a")
        });
        assert!(s.pending_publishes.is_empty(), "finish={finish}");
        assert_eq!(s.cache().stats().checkpoints_pending, 0, "finish={finish}");
        assert_eq!(src as i64, window[1]);
        assert_eq!(
            s.cache().debug_tag(src).map(|t| t.1),
            Some(8),
            "finish={finish}"
        );
        assert_eq!(
            s.cache().debug_tag(dst),
            None,
            "the reserved slot is given back"
        );
        // a prompt through position 8 resumes from that state
        s.add_request(NewRequest::new("b", vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 30], 4))
            .unwrap();
        let o = s.schedule().unwrap();
        assert_eq!(o.num_computed_tokens, vec![8], "finish={finish}");
        assert_eq!(
            o.state_copies[..2],
            [src as i64, o.state_read_slot[0]],
            "finish={finish}: the kept state is copied into b's window"
        );
    }
}

#[test]
fn a_stop_string_on_a_grid_point_keeps_the_last_token_state_where_the_placement_keeps_one() {
    // Computed 6 -> 8 (one draft accepted and the correction): the grid point 8 is the last
    // computed token, its publish the live slot's own. A stop string ends the request there:
    // with branch points the slot is kept as the last-token state, as when the scheduler ends a
    // request on a boundary; with the grid alone as the grid checkpoint. One checkpoint either
    // way, nothing pending.
    // (an abort keeps no last-token state: the slot stays the grid checkpoint it was published as)
    for (placement, abort) in [
        (CheckpointPlacement::Grid, false),
        (CheckpointPlacement::BranchAndGrid, false),
        (CheckpointPlacement::BranchAndGrid, true),
    ] {
        let mut c = cfg(MambaCacheMode::Align, 3);
        c.checkpoint_placement = placement;
        let mut s = Scheduler::new(&c, 256, 64, 0).unwrap();
        s.add_request(NewRequest::new("a", (1..=6).collect(), 50))
            .unwrap();
        let o = s.schedule().unwrap();
        s.update_from_output(&o, &[7], &[1], Some((&[8, 9, 10], &[3])))
            .unwrap();
        let o = s.schedule().unwrap();
        s.update_from_output(&o, &[8, 11], &[2], Some((&[], &[0])))
            .unwrap();
        let (src, _) = s.pending_publishes[0];
        assert_eq!(s.get_request("a").unwrap().num_computed_tokens, 8);
        assert!(if abort {
            s.abort_request("a")
        } else {
            s.finish_request("a")
        });
        let st = s.cache().stats();
        let at = format!("{placement:?}, abort {abort}");
        assert_eq!(
            (st.checkpoints_pending, st.checkpoints_committed),
            (0, 1),
            "{at}"
        );
        assert_eq!(s.cache().debug_tag(src).map(|t| t.1), Some(8), "{at}");
        let last_token = placement == CheckpointPlacement::BranchAndGrid && !abort;
        let kind = if last_token {
            CheckpointKind::LastToken
        } else {
            CheckpointKind::Grid
        };
        assert_eq!(st.checkpoints_by_kind[kind.index()], 1, "{at}");
        // counted once, as the kind it became
        let counts = (s.stats().checkpoints_published, s.stats().checkpoints_kept);
        assert_eq!(counts, if last_token { (0, 1) } else { (1, 0) }, "{at}");
    }
}

#[test]
fn rejected_drafts_never_publish() {
    let (mut s, o) = at_first_verify_step(MambaCacheMode::Align, 50);
    // Only the correction token: computed 6 -> 7, boundary 8 (a draft position) not reached.
    s.update_from_output(&o, &[20], &[1], None).unwrap();
    assert!(s.pending_publishes.is_empty());
    assert_eq!(s.get_request("a").unwrap().num_computed_tokens, 7);
    assert_eq!(s.get_request("a").unwrap().live_window_index, 0);
}

#[test]
fn max_tokens_caps_the_drafts() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::None, 4), 256, 64, 0).unwrap();
    s.add_request(NewRequest::new("a", vec![1, 2, 3], 3))
        .unwrap();
    let o = s.schedule().unwrap();
    s.update_from_output(&o, &[4], &[1], Some((&[5, 6, 7, 8], &[4])))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.num_draft_tokens, vec![1]);
    assert_eq!(o.draft_token_ids, vec![5]);
}

#[test]
fn stop_token_inside_accepted_drafts_cuts_the_rest() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::None, 3), 256, 64, 0).unwrap();
    let mut nr = NewRequest::new("a", vec![1, 2, 3], 30);
    nr.stop.eos_token_id = Some(99);
    s.add_request(nr).unwrap();
    let o = s.schedule().unwrap();
    s.update_from_output(&o, &[4], &[1], Some((&[5, 99, 7], &[3])))
        .unwrap();
    let o = s.schedule().unwrap();
    let d = s
        .update_from_output(&o, &[5, 99, 7, 8], &[4], None)
        .unwrap();
    assert_eq!(d[0].new_token_ids, vec![5, 99]);
    assert_eq!(d[0].finish_reason, Some(FinishReason::Stop));
    assert_eq!(d[0].stop_token_id, Some(99));
    assert!(!s.has_unfinished_requests());
    assert_eq!(s.stats().cache.kv_blocks_used, 0);
}

#[test]
fn preemption_takes_lowest_priority_then_newest() {
    let c = cfg(MambaCacheMode::None, 0);
    // 12 usable blocks of 4 tokens.
    let mut s = Scheduler::new(&c, 13, 64, 0).unwrap();
    let a = NewRequest::new("old", vec![1; 16], 30);
    let b = NewRequest::new("new", vec![2; 16], 30);
    let mut lo = NewRequest::new("low", vec![3; 16], 30);
    lo.priority = 5;
    s.add_request(lo).unwrap();
    s.add_request(a).unwrap();
    s.add_request(b).unwrap();
    // Waiting order by priority then arrival: old, new, low.
    let o = s.schedule().unwrap();
    assert_eq!(ids(&o), vec!["old", "new", "low"]);
    s.update_from_output(&o, &[1, 1, 1], &[1, 1, 1], None)
        .unwrap();
    // Each holds 4 blocks (16 tokens); the decode at 16 needs a 5th block: "low" goes first.
    let o = s.schedule().unwrap();
    assert_eq!(ids(&o), vec!["old", "new"]);
    assert_eq!(
        s.get_request("low").unwrap().status,
        RequestStatus::Preempted
    );
    assert_eq!(s.stats().num_preempted, 1);
    s.update_from_output(&o, &[1, 1], &[1, 1], None).unwrap();
}

#[test]
fn request_that_cannot_fit_alone_finishes_with_length() {
    let c = cfg(MambaCacheMode::None, 0);
    let mut s = Scheduler::new(&c, 5, 64, 0).unwrap(); // 4 usable blocks = 16 tokens
    assert!(s
        .add_request(NewRequest::new("big", vec![1; 16], 5))
        .is_err());
    s.add_request(NewRequest::new("a", vec![1; 14], 10))
        .unwrap();
    let mut reasons = Vec::new();
    let mut refused_while_pending = false;
    for _ in 0..10 {
        let o = s.schedule().unwrap();
        if s.get_token_ids("a").is_none() && s.has_unfinished_requests() {
            // decided, not yet reported: the id is still in use (the next update would report
            // a new request of that id as finished)
            assert!(s.add_request(NewRequest::new("a", vec![2; 3], 1)).is_err());
            refused_while_pending = true;
        }
        let ns: Vec<i32> = o.num_logits.clone();
        let n: usize = ns.iter().map(|&x| x as usize).sum();
        for d in s.update_from_output(&o, &vec![3; n], &ns, None).unwrap() {
            if d.finished {
                reasons.push((
                    d.request_id.to_string(),
                    d.finish_reason,
                    d.new_token_ids.len(),
                ));
            }
        }
        if !s.has_unfinished_requests() {
            break;
        }
    }
    assert_eq!(
        reasons,
        vec![("a".to_string(), Some(FinishReason::Length), 0)]
    );
    assert!(refused_while_pending);
    assert_eq!(s.get_token_ids("a"), None);
    assert_eq!(s.stats().cache.kv_blocks_used, 0);
}

#[test]
fn max_num_seqs_limits_running() {
    let mut c = cfg(MambaCacheMode::None, 0);
    c.max_num_seqs = 2;
    let mut s = Scheduler::new(&c, 256, 64, 0).unwrap();
    for i in 0..4 {
        s.add_request(NewRequest::new(format!("r{i}"), vec![1, 2], 3))
            .unwrap();
    }
    let o = s.schedule().unwrap();
    assert_eq!(ids(&o), vec!["r0", "r1"]);
    assert_eq!(s.num_running(), 2);
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn abort_in_every_state_frees_everything() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::Align, 2), 64, 32, 0).unwrap();
    s.add_request(NewRequest::new("run", vec![1; 20], 10))
        .unwrap();
    s.add_request(NewRequest::new("wait", vec![1; 20], 10))
        .unwrap();
    let o = s.schedule().unwrap();
    assert!(s.abort_request("run"), "abort while in flight");
    assert!(s.abort_request("wait"));
    assert!(!s.abort_request("run"));
    let d = s.update_from_output(
        &o,
        &[],
        &o.num_logits.iter().map(|_| 0).collect::<Vec<_>>(),
        None,
    );
    assert!(d.is_err() || d.unwrap().is_empty());
    let o = s.schedule();
    let o = match o {
        Ok(o) => o,
        Err(_) => panic!("schedule after abort"),
    };
    let mut f = o.finished_req_ids.clone();
    f.sort();
    assert_eq!(f, vec!["run", "wait"]);
    let st = s.stats();
    assert_eq!(st.cache.kv_blocks_used, 0);
    assert_eq!(st.num_aborted_total, 2);
    assert!(!s.has_unfinished_requests());
}

#[test]
fn finish_request_frees_like_abort_and_counts_as_finished() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::None, 2), 64, 32, 0).unwrap();
    s.add_request(NewRequest::new("a", vec![1; 20], 10))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(o.num_logits, vec![1]);
    s.update_from_output(&o, &[7], &[1], None).unwrap();
    assert!(s.stats().cache.kv_blocks_used > 0);
    assert!(s.finish_request("a"));
    assert!(!s.finish_request("a"), "only once");
    assert!(!s.abort_request("a"));
    let o = s.schedule().unwrap();
    assert_eq!(o.finished_req_ids, vec!["a"]);
    let st = s.stats();
    assert_eq!(st.cache.kv_blocks_used, 0);
    assert_eq!((st.num_finished_total, st.num_aborted_total), (1, 0));
    assert!(!s.has_unfinished_requests());
}

#[test]
fn update_validates_its_input_and_keeps_state() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::None, 2), 64, 32, 0).unwrap();
    s.add_request(NewRequest::new("a", vec![1, 2, 3], 10))
        .unwrap();
    let o = s.schedule().unwrap();
    assert!(
        s.update_from_output(&o, &[1, 2], &[2], None).is_err(),
        "prefill samples one"
    );
    assert!(s.update_from_output(&o, &[1], &[1, 0], None).is_err());
    assert!(s.update_from_output(&o, &[-1], &[1], None).is_err());
    assert!(s
        .update_from_output(&o, &[1], &[1], Some((&[1], &[2])))
        .is_err());
    assert!(s.schedule().is_err(), "previous step not updated");
    s.update_from_output(&o, &[4], &[1], None).unwrap();
    assert!(
        s.update_from_output(&o, &[4], &[1], None).is_err(),
        "applied twice"
    );
    assert_eq!(s.get_token_ids("a"), Some(&[1, 2, 3, 4][..]));
}

#[test]
fn prefix_hit_is_reported_and_reused_state_is_correct() {
    let mut sim = Sim::new(cfg(MambaCacheMode::Align, 0), 256, 64, 3);
    let prompt: Vec<u32> = (1..=40).collect();
    sim.add("a", prompt.clone(), 4, None);
    sim.run_to_end(100);
    let mut p2 = prompt.clone();
    p2.extend([7, 7, 7]);
    sim.add("b", p2, 4, None);
    sim.run_to_end(100);
    sim.check_end();
    let st = sim.s.stats();
    assert_eq!(st.prefix_hit_tokens, 40);
    assert!(sim.emits > 0);
}

#[test]
fn align_publishes_the_end_of_a_shared_prefix_that_lost_its_state() {
    // "a" prefills its 40 tokens in one chunk: checkpoints at 40 (and none at 24). "b" shares
    // the first 26 tokens: its KV hit is 24 tokens (6 blocks of 4) but no state exists there, so
    // it recomputes from 0 and ends its first chunk at 24, publishing that state. "c", sharing the
    // same 26 tokens, then hits 24.
    let mut sim = Sim::new(cfg(MambaCacheMode::Align, 0), 256, 64, 5);
    let shared: Vec<u32> = (1..=26).collect();
    let with = |tail: &[u32]| -> Vec<u32> { shared.iter().chain(tail).copied().collect() };
    sim.add("a", with(&(30..44).collect::<Vec<u32>>()), 3, None);
    sim.run_to_end(100);
    sim.add("b", with(&[9; 10]), 3, None);
    sim.run_to_end(100);
    let st = sim.s.stats();
    assert_eq!((st.prefix_hit_tokens, st.prefix_lost_tokens), (0, 24));
    sim.add("c", with(&[8; 12]), 3, None);
    sim.run_to_end(100);
    sim.check_end();
    let st = sim.s.stats();
    assert_eq!(st.prefix_hit_tokens, 24, "c hits the state b published");
    assert_eq!(st.prefix_lost_tokens, 24, "only b lost its prefix");
}

#[test]
fn multi_turn_hits_on_decode_published_checkpoints() {
    // The second turn's prompt = first prompt + output: its hit at 24 needs the state published
    // from a decode step (the prompt ends at 10).
    for mode in [MambaCacheMode::Align, MambaCacheMode::All] {
        for k in [0, 2] {
            let mut sim = Sim::new(cfg(mode, k), 256, 64, 11);
            sim.add("t1", (1..=10).collect(), 20, None);
            sim.run_to_end(200);
            let r = sim.reqs["t1"].clone();
            let mut p2 = r.seq();
            p2.extend([3, 4, 5]);
            sim.add("t2", p2, 3, None);
            sim.run_to_end(200);
            sim.check_end();
            assert_eq!(sim.s.stats().prefix_hit_tokens, 24, "{mode:?} k={k}");
        }
    }
}

#[test]
fn branch_point_is_kept_for_the_next_sharer() {
    // "a" computes 40 tokens; "b" shares the first 26: its KV hit is 24 tokens (6 blocks of 4)
    // with no state there, so it starts from 0 and keeps the state at 24 itself (align: its first
    // chunk ends there; all: the scan emits it from inside the row). "c" then hits exactly 24,
    // off the grid of 8.
    for mode in CHECKPOINT_MODES {
        for k in [0, 2] {
            let mut sim = Sim::new(cfg_branch(mode, k, EvictionPolicy::Flops), 256, 64, 5);
            let shared: Vec<u32> = (1..=26).collect();
            let with = |tail: &[u32]| -> Vec<u32> { shared.iter().chain(tail).copied().collect() };
            sim.add("a", with(&(30..44).collect::<Vec<u32>>()), 3, None);
            sim.run_to_end(100);
            sim.add("b", with(&[9; 10]), 3, None);
            sim.run_to_end(100);
            let first_b = sim.row_log.iter().find(|r| r.0 == "b").unwrap().clone();
            match mode {
                // The first chunk ends at the branch point; its last token is emitted.
                MambaCacheMode::Align => assert_eq!(first_b, ("b".into(), 0, 24, vec![23])),
                // One chunk; the scan emits the state after token 24 from inside it.
                _ => assert_eq!(first_b, ("b".into(), 0, 36, vec![23])),
            }
            let st = sim.s.stats();
            assert_eq!((st.prefix_hit_tokens, st.prefix_lost_tokens), (0, 24));
            sim.add("c", with(&[8; 12]), 3, None);
            sim.run_to_end(100);
            sim.check_end();
            let st = sim.s.stats();
            assert_eq!(
                st.prefix_hit_tokens, 24,
                "{mode:?} k={k}: c hits b's branch point"
            );
            assert_eq!(st.prefix_hits_by_kind, [0, 1, 0, 0]);
            assert_eq!(st.cache.checkpoints_by_kind[0], 0, "no grid checkpoint");
        }
    }
}

#[test]
fn a_declared_shared_prefix_is_kept_by_its_first_user() {
    // "a" declares that its first 26 tokens are shared: it keeps the state at 24, the last full
    // block (align: its first chunk ends there; all: the scan emits it from inside the row), so
    // "b", the second sharer, already hits 24 where it would otherwise be the one to find the
    // branch point. Grid placement ignores the declaration.
    for mode in CHECKPOINT_MODES {
        for k in [0, 2] {
            for placement in [CheckpointPlacement::Branch, CheckpointPlacement::Grid] {
                let mut c = cfg_branch(mode, k, EvictionPolicy::Flops);
                c.checkpoint_placement = placement;
                let mut sim = Sim::new(c, 256, 64, 5);
                let shared: Vec<u32> = (1..=26).collect();
                let with =
                    |tail: &[u32]| -> Vec<u32> { shared.iter().chain(tail).copied().collect() };
                sim.add_prio("a", with(&[9; 10]), 3, None, 0, Some(26));
                sim.run_to_end(100);
                let first_a = sim.row_log.iter().find(|r| r.0 == "a").unwrap().clone();
                sim.add_prio("b", with(&[8; 12]), 3, None, 0, Some(26));
                sim.run_to_end(100);
                sim.check_end();
                let st = sim.s.stats();
                let what = format!("{mode:?} k={k} {placement:?}");
                if placement == CheckpointPlacement::Grid {
                    assert_eq!(st.prefix_hits_by_kind[3], 0, "{what}");
                    continue;
                }
                match mode {
                    MambaCacheMode::Align => {
                        assert_eq!(first_a, ("a".into(), 0, 24, vec![23]), "{what}")
                    }
                    _ => assert_eq!(first_a, ("a".into(), 0, 36, vec![23]), "{what}"),
                }
                assert_eq!(
                    st.prefix_hit_tokens, 24,
                    "{what}: b hits a's declared prefix"
                );
                assert_eq!(st.prefix_hits_by_kind, [0, 0, 0, 1], "{what}");
                assert_eq!(st.prefix_lost_tokens, 0, "{what}");
            }
        }
    }
}

#[test]
fn a_declared_shared_prefix_longer_than_the_prompt_is_refused() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::All, 0), 64, 16, 1).unwrap();
    let mut nr = NewRequest::new("r", vec![1, 2, 3], 4);
    nr.shared_prefix_len = Some(4);
    let err = s.add_request(nr).unwrap_err().to_string();
    assert!(
        err.contains("shared_prefix_len (4) is longer than the prompt (3 tokens)"),
        "{err}"
    );
    assert!(!s.has_unfinished_requests(), "nothing was added");
    let mut nr = NewRequest::new("r", vec![1, 2, 3], 4);
    nr.shared_prefix_len = Some(3);
    s.add_request(nr).unwrap();
}

/// t1's next turn: "t2", t1's tokens and three more, run to the end and every output checked.
fn next_turn(sim: &mut Sim) -> SchedulerStats {
    let mut p2 = sim.reqs["t1"].seq();
    p2.extend([3, 4, 5]);
    sim.add("t2", p2, 3, None);
    sim.run_to_end(200);
    sim.check_end();
    sim.s.stats()
}

#[test]
fn last_token_checkpoint_serves_the_next_turn_exactly() {
    // t1 (10 prompt tokens, 20 generated) has computed 29 tokens when it finishes: a state at 29,
    // inside block 7, and a tail entry for tokens 28..29. The next turn (t1's 30 tokens + 3) hits
    // 29 exactly: the tail block is copied into one of t2's own, the state into its window.
    for mode in CHECKPOINT_MODES {
        for k in [0, 2] {
            for (max_tokens, expect) in [(20, 29), (19, 28)] {
                let mut sim = Sim::new(cfg_branch(mode, k, EvictionPolicy::Flops), 256, 64, 11);
                sim.draft_quality = 8;
                sim.add("t1", (1..=10).collect(), max_tokens, None);
                sim.run_to_end(200);
                assert_eq!(sim.s.stats().checkpoints_kept, 1);
                let st = next_turn(&mut sim);
                assert_eq!(st.prefix_hit_tokens, expect, "{mode:?} k={k}");
                assert_eq!(st.prefix_hits_by_kind, [0, 0, 1, 0]);
                let tail = expect % 4 != 0;
                assert_eq!(
                    (sim.tail_hits, sim.kv_copies),
                    (tail as usize, tail as usize)
                );
            }
        }
    }
}

#[test]
fn a_follow_up_right_after_a_finish_on_a_grid_boundary_hits_it() {
    // t1 computes 8 tokens (6 + 3 - 1), M = 8: the last state is kept at once, not published by a
    // copy that would wait for a next step; t2, admitted in the very next schedule(), hits it.
    for k in [0, 2] {
        let mut c = cfg(MambaCacheMode::All, k);
        c.checkpoint_placement = CheckpointPlacement::BranchAndGrid;
        c.eviction = EvictionPolicy::Flops;
        let mut sim = Sim::new(c, 256, 64, 5);
        sim.draft_quality = 8;
        sim.add("t1", (1..=6).collect(), 3, None);
        sim.run_to_end(50);
        assert_eq!(sim.s.pending_publishes.len(), 0, "k={k}");
        assert_eq!(run_t2_on_t1s_prefix(&mut sim), 8, "k={k}");
        assert_eq!(sim.s.stats().prefix_hits_by_kind, [0, 0, 1, 0]);
    }
}

#[test]
fn a_finish_by_stop_string_keeps_the_last_state_and_an_abort_does_not() {
    for (finish, kept) in [(true, 1), (false, 0)] {
        let mut sim = Sim::new(
            cfg_branch(MambaCacheMode::Align, 0, EvictionPolicy::Lru),
            256,
            64,
            3,
        );
        sim.add("a", (1..=10).collect(), 20, None);
        for _ in 0..4 {
            sim.step();
        }
        if finish {
            assert!(sim.s.finish_request("a"));
        } else {
            assert!(sim.s.abort_request("a"));
        }
        assert_eq!(sim.s.stats().checkpoints_kept, kept);
        assert_eq!(sim.s.stats().cache.kv_blocks_used, 0);
    }
}

#[test]
fn a_cancelled_step_commits_nothing_and_its_requests_recompute() {
    // The forward of a step that emits a checkpoint never runs: the checkpoint must not become a
    // hit (its slot holds whatever was there before), and the request starts over.
    for mode in CHECKPOINT_MODES {
        let mut sim = Sim::new(cfg(mode, 0), 256, 64, 13);
        sim.add("a", (1..=20).collect(), 4, None);
        let o = sim.s.schedule().unwrap();
        assert!(
            !o.pending_checkpoints.is_empty(),
            "{mode:?}: the step emits"
        );
        assert!(sim.s.update_from_output(&o, &[], &[], None).is_err());
        assert!(sim.s.cancel_step(&o).unwrap().is_empty());
        assert!(sim.s.cancel_step(&o).is_err(), "already closed");
        let st = sim.s.stats();
        assert_eq!(
            (st.cache.checkpoints_pending, st.cache.checkpoints_committed),
            (0, 0)
        );
        assert_eq!(
            (st.num_running, st.num_waiting, st.cache.kv_blocks_used),
            (0, 1, 0)
        );
        sim.run_to_end(100);
        sim.check_end();
    }
}

// ------------------------------------------------------------------ simulation

/// (arrival step, id, prompt, max_tokens, declared shared prefix) of `n` requests: each starts
/// with one of `shared` and half of them declare it (`NewRequest::shared_prefix_len`).
type Arrival = (usize, String, Vec<u32>, usize, Option<usize>);

fn workload(sim: &mut Sim, n: usize, shared: &[Vec<u32>], seed: u64) -> Vec<Arrival> {
    let mut rng = Rng(seed);
    let mut out = Vec::new();
    for i in 0..n {
        let mut p = shared[rng.below(shared.len())].clone();
        let declared = (rng.below(2) == 0).then_some(p.len());
        let extra = 1 + rng.below(40);
        p.extend((0..extra).map(|_| 1 + rng.below(sim.vocab as usize) as u32));
        let at = rng.below(n * 2);
        out.push((at, format!("r{i}"), p, 1 + rng.below(30), declared));
    }
    out.sort_by_key(|x| x.0);
    out
}

#[allow(clippy::too_many_arguments)]
fn simulate(
    mode: MambaCacheMode,
    k: usize,
    blocks: usize,
    slots: usize,
    budget: usize,
    chunked: bool,
    n: usize,
    abort_every: usize,
    seed: u64,
) -> Sim {
    simulate_with(
        mode,
        k,
        blocks,
        slots,
        budget,
        chunked,
        n,
        abort_every,
        seed,
        |_| {},
    )
}

#[allow(clippy::too_many_arguments)]
fn simulate_with(
    mode: MambaCacheMode,
    k: usize,
    blocks: usize,
    slots: usize,
    budget: usize,
    chunked: bool,
    n: usize,
    abort_every: usize,
    seed: u64,
    tweak: impl Fn(&mut ResolvedConfig),
) -> Sim {
    simulate_full(
        mode,
        k,
        (blocks, slots),
        budget,
        chunked,
        n,
        abort_every,
        seed,
        false,
        tweak,
    )
}

#[allow(clippy::too_many_arguments)]
fn simulate_full(
    mode: MambaCacheMode,
    k: usize,
    (blocks, slots): (usize, usize),
    budget: usize,
    chunked: bool,
    n: usize,
    abort_every: usize,
    seed: u64,
    plan_ahead: bool,
    tweak: impl Fn(&mut ResolvedConfig),
) -> Sim {
    let mut c = cfg(mode, k);
    c.max_num_batched_tokens = budget;
    c.enable_chunked_prefill = chunked || mode == MambaCacheMode::Align;
    c.max_num_seqs = 8;
    c.max_model_len = 200;
    tweak(&mut c);
    let mut sim = Sim::new(c, blocks, slots, seed);
    sim.plan_ahead = plan_ahead;
    let mut rng = Rng(seed ^ 0x55);
    let shared: Vec<Vec<u32>> = (0..3)
        .map(|j| {
            (0..(8 + 13 * j))
                .map(|_| 1 + rng.below(50) as u32)
                .collect()
        })
        .collect();
    let mut arrivals = workload(&mut sim, n, &shared, seed);
    let mut t = 0usize;
    let mut idle = 0;
    let mut aborted = 0;
    while !arrivals.is_empty() || sim.s.has_unfinished_requests() {
        while let Some((at, _, _, _, _)) = arrivals.first() {
            if *at > t {
                break;
            }
            let (_, id, p, mt, declared) = arrivals.remove(0);
            let eos = if rng.below(2) == 0 {
                Some(1 + rng.below(50) as u32)
            } else {
                None
            };
            let budget_ok = c_prompt_ok(&sim.cfg, p.len(), blocks);
            if budget_ok {
                let prio = rng.below(3) as i64;
                sim.add_prio(&id, p, mt, eos, prio, declared);
            }
        }
        if abort_every > 0 && rng.below(abort_every) == 0 {
            let ids: Vec<String> = sim
                .reqs
                .iter()
                .filter(|(_, r)| r.finished.is_none())
                .map(|(id, _)| id.clone())
                .collect();
            if !ids.is_empty() {
                let mut ids = ids;
                ids.sort();
                let id = ids[rng.below(ids.len())].clone();
                sim.abort(&id);
                aborted += 1;
            }
        }
        if sim.step() == 0 && sim.s.has_unfinished_requests() {
            idle += 1;
            assert!(idle < 3, "no progress although requests are unfinished");
        } else {
            idle = 0;
        }
        t += 1;
        assert!(t < 20_000, "does not terminate");
    }
    assert!(sim.next.is_none());
    let _ = aborted;
    sim.check_end();
    sim
}

fn c_prompt_ok(cfg: &ResolvedConfig, len: usize, blocks: usize) -> bool {
    len < cfg.max_model_len
        && (len + 1).div_ceil(cfg.block_size) < blocks
        && (cfg.enable_chunked_prefill || len <= cfg.max_num_batched_tokens)
}

#[test]
fn simulation_all_modes_with_spec_and_preemption() {
    for (i, mode) in ALL_MODES.into_iter().enumerate() {
        for k in [0, 3] {
            let sim = simulate(
                mode,
                k,
                40,
                40,
                48,
                true,
                24,
                0,
                100 + i as u64 * 7 + k as u64,
            );
            assert!(
                sim.s.stats().num_preemptions_total > 0,
                "tiny pool should preempt"
            );
            if mode != MambaCacheMode::None {
                assert!(
                    sim.s.stats().prefix_hit_tokens > 0,
                    "{mode:?} k={k}: shared prefixes should hit"
                );
            }
            if k > 0 {
                assert!(sim.s.stats().spec_accepted_tokens > 0);
            }
            assert!(sim.max_wait < 2000);
        }
    }
}

#[test]
fn simulation_branch_placements_and_evictions() {
    let placements = [
        CheckpointPlacement::Branch,
        CheckpointPlacement::BranchAndGrid,
    ];
    let evictions = [
        EvictionPolicy::Flops,
        EvictionPolicy::Lru,
        EvictionPolicy::LruPath,
    ];
    let mut tail_hits = 0;
    let mut declared_hits = 0;
    for (i, mode) in CHECKPOINT_MODES.into_iter().enumerate() {
        for (j, placement) in placements.into_iter().enumerate() {
            for (e, eviction) in evictions.into_iter().enumerate() {
                for k in [0, 3] {
                    let seed = 300 + (i * 100 + j * 10 + e) as u64 * 7 + k as u64;
                    let sim = simulate_with(mode, k, 40, 24, 48, true, 24, 0, seed, |c| {
                        c.checkpoint_placement = placement;
                        c.eviction = eviction;
                    });
                    let st = sim.s.stats();
                    assert!(st.num_preemptions_total > 0, "tiny pool should preempt");
                    assert!(
                        st.prefix_hit_tokens > 0,
                        "{mode:?} {placement:?} {eviction:?}"
                    );
                    assert!(st.cache.checkpoint_evictions > 0, "a small pool evicts");
                    tail_hits += sim.tail_hits;
                    declared_hits += st.prefix_hits_by_kind[3];
                }
            }
        }
    }
    assert!(tail_hits > 0, "preempted requests resumed inside a block");
    assert!(declared_hits > 0, "second sharers hit declared prefixes");
}

#[test]
fn simulation_with_aborts_and_chunked_prefill_off() {
    let sim = simulate(MambaCacheMode::All, 2, 64, 40, 64, false, 20, 6, 9);
    assert!(sim.s.stats().num_aborted_total > 0);
    let sim = simulate(MambaCacheMode::None, 0, 64, 40, 64, false, 20, 0, 10);
    let _ = sim;
}

#[test]
fn simulation_attention_only_model_hits_kv() {
    let sim = simulate_with(MambaCacheMode::None, 2, 60, 40, 48, true, 24, 0, 21, |c| {
        c.has_mamba_layers = false;
        c.enable_prefix_caching = true;
    });
    assert!(sim.s.stats().prefix_hit_tokens > 0);
    // A Mamba model in mode none with prefix caching on cannot hit.
    let sim = simulate_with(MambaCacheMode::None, 2, 60, 40, 48, true, 24, 0, 22, |c| {
        c.enable_prefix_caching = true;
    });
    assert_eq!(sim.s.stats().prefix_hit_tokens, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]
    #[test]
    fn random_workloads_keep_the_invariants(
        mode in prop_oneof![Just(MambaCacheMode::None), Just(MambaCacheMode::Align), Just(MambaCacheMode::All)],
        k in 0usize..4,
        blocks in 30usize..120,
        slots in 2usize..60,
        budget in prop_oneof![Just(16usize), Just(24), Just(64)],
        chunked in any::<bool>(),
        n in 1usize..24,
        abort_every in prop_oneof![Just(0usize), Just(4), Just(12)],
        seed in any::<u64>(),
        variant in 0usize..4,
        placement in prop_oneof![
            Just(CheckpointPlacement::Grid),
            Just(CheckpointPlacement::Branch),
            Just(CheckpointPlacement::BranchAndGrid),
        ],
        eviction in prop_oneof![
            Just(EvictionPolicy::Flops),
            Just(EvictionPolicy::Lru),
            Just(EvictionPolicy::LruPath),
        ],
    ) {
        // At least one state window must fit next to the null slot.
        let slots = slots.max(1 + (1 + k));
        simulate_with(mode, k, blocks, slots, budget, chunked, n, abort_every, seed, |c| {
            c.checkpoint_placement = placement;
            c.eviction = eviction;
            match variant {
                1 => {
                    c.has_mamba_layers = false;
                    c.enable_prefix_caching = true;
                }
                2 => c.enable_prefix_caching = true,
                _ => {}
            }
        });
    }
}

/// A scheduler with room for exactly two windows in which t1 (6 prompt tokens, 3 to generate)
/// has finished in the step that reaches the checkpoint boundary at 8.
fn finished_on_a_boundary(k: usize) -> Sim {
    let mut c = cfg(MambaCacheMode::Align, k);
    c.max_num_seqs = 2;
    let slots = 1 + 2 * (1 + k) + 2;
    let mut sim = Sim::new(c, 256, slots, 5);
    sim.draft_quality = 8;
    sim.add("t1", (1..=6).collect(), 3, None);
    sim.run_to_end(50);
    sim
}

/// Runs t2 (t1's whole sequence plus two tokens) to the end; returns the prefix hit tokens.
fn run_t2_on_t1s_prefix(sim: &mut Sim) -> u64 {
    let mut p2 = sim.reqs["t1"].seq();
    p2.extend([7, 7]);
    sim.add("t2", p2, 2, None);
    sim.run_to_end(50);
    sim.check_end();
    sim.s.stats().prefix_hit_tokens
}

#[test]
fn a_finishing_request_keeps_its_boundary_slot_through_slot_reuse() {
    // t1 finishes in the very step whose accepted token reaches the boundary at 8: the window slot
    // holding that state becomes the checkpoint at once (no copy waits for a next step), and its
    // other slots are freed. "x", admitted then and handed the freed slots, cannot write it: t2
    // hits it.
    for k in [0, 2] {
        // Exactly two windows: x must reuse t1's slots.
        let mut sim = finished_on_a_boundary(k);
        assert_eq!(sim.s.stats().checkpoints_published, 1);
        assert!(sim.s.pending_publishes.is_empty(), "k={k}");
        let st = sim.s.stats().cache;
        assert_eq!(
            (st.checkpoints_pending, st.checkpoints_committed),
            (0, 1),
            "k={k}"
        );
        sim.add("x", (20..=29).collect(), 4, None);
        sim.step();
        assert_eq!(run_t2_on_t1s_prefix(&mut sim), 8, "k={k}");
    }
}

#[test]
fn a_boundary_crossed_in_a_requests_last_verify_step_is_a_hit_at_once() {
    // a (6 prompt tokens, 5 to generate, K = 3) computes 6 -> 10 in its last step, every draft
    // accepted, crossing the grid boundary at 8 (window[1]). The engine then idles: no next step
    // would run a publish copy, so the state is kept in place, and b, admitted in the very next
    // schedule(), hits it.
    for mode in CHECKPOINT_MODES {
        let (mut s, o) = at_first_verify_step(mode, 5);
        let window: Vec<i64> = o.write_slots_row(0).to_vec();
        let d = s
            .update_from_output(&o, &[8, 9, 10, 11], &[4], Some((&[], &[0])))
            .unwrap();
        assert!(d.iter().any(|d| d.finished), "{mode:?}: max_tokens ends a");
        assert!(s.pending_publishes.is_empty(), "{mode:?}");
        let st = s.stats();
        assert_eq!(st.checkpoints_published, 1, "{mode:?}");
        assert_eq!(
            (st.cache.checkpoints_pending, st.cache.checkpoints_committed),
            (0, 1),
            "{mode:?}"
        );
        let mut p2: Vec<u32> = (1..=11).collect();
        p2.extend([7, 7]);
        s.add_request(NewRequest::new("b", p2, 2)).unwrap();
        let o = s.schedule().unwrap();
        assert_eq!(o.num_computed_tokens, vec![8], "{mode:?}: b resumes at 8");
        assert_eq!(
            o.state_copies[..2],
            [window[1], o.state_read_slot[0]],
            "{mode:?}: from the slot that held the state after 8"
        );
    }
}

#[test]
fn a_reset_of_an_idle_engine_drops_the_last_steps_boundary() {
    // t1 finishes in the step that reaches the boundary at 8, which it keeps as a checkpoint. The
    // reset of the idle engine empties the cache.
    for k in [0, 2] {
        let mut sim = finished_on_a_boundary(k);
        assert!(sim.s.pending_publishes.is_empty(), "k={k}");
        assert!(sim.s.reset_prefix_cache(), "k={k}");
        let st = sim.s.stats();
        assert_eq!(
            st.cache.checkpoints_pending + st.cache.checkpoints_committed,
            0
        );
        assert_eq!(st.cache.mamba_slots_used, 0);
        assert_eq!(st.cache.kv_blocks_cached, 0);
        // the engine runs on, and a prompt sharing t1's prefix now misses
        assert_eq!(run_t2_on_t1s_prefix(&mut sim), 0, "k={k}");
    }
}

#[test]
fn rows_of_requests_aborted_mid_step_may_sample_nothing() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::None, 0), 64, 32, 0).unwrap();
    s.add_request(NewRequest::new("a", vec![1, 2, 3], 5))
        .unwrap();
    s.add_request(NewRequest::new("b", vec![4, 5, 6], 5))
        .unwrap();
    let o = s.schedule().unwrap();
    assert!(s.abort_request("a"));
    let d = s.update_from_output(&o, &[9], &[0, 1], None).unwrap();
    assert_eq!(d.len(), 1);
    assert_eq!(&*d[0].request_id, "b");
    assert!(
        s.update_from_output(&o, &[9], &[0, 1], None).is_err(),
        "already applied"
    );
}

#[test]
fn in_flight_step_is_the_scheduled_step_until_its_update() {
    let mut s = Scheduler::new(&cfg(MambaCacheMode::None, 0), 64, 32, 0).unwrap();
    assert_eq!(s.in_flight_step(), None);
    s.add_request(NewRequest::new("a", vec![1, 2, 3], 4))
        .unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(s.in_flight_step(), Some(o.step_id));
    s.update_from_output(&o, &[5], &[1], None).unwrap();
    assert_eq!(s.in_flight_step(), None);
}

// ------------------------------------------------------------------ steps planned ahead

#[test]
fn steps_planned_ahead_give_every_request_its_true_output() {
    // Random arrivals, priorities, EOS tokens, aborts and preemption, every step that can be
    // planned ahead planned so: the Sim checks each row's tokens, KV and initial state, and
    // `check_end` every output and that nothing leaks. Rows of requests an EOS ended while their
    // next step was planned run writing nothing that is read.
    let (mut planned, mut dead) = (0, 0);
    for (i, mode) in ALL_MODES.into_iter().enumerate() {
        for (blocks, abort_every) in [(40, 0), (200, 9)] {
            let sim = simulate_full(
                mode,
                0,
                (blocks, 40),
                48,
                true,
                24,
                abort_every,
                300 + i as u64 * 7 + blocks as u64,
                true,
                |_| {},
            );
            planned += sim.planned_steps;
            dead += sim.dead_rows;
            if mode != MambaCacheMode::None {
                assert!(sim.s.stats().prefix_hit_tokens > 0, "{mode:?}");
            }
        }
    }
    assert!(planned > 50, "{planned} steps planned ahead");
    assert!(dead > 0, "no planned row outlived its request");
}

#[test]
fn a_step_is_planned_ahead_only_where_its_plan_cannot_depend_on_the_running_step() {
    let mut c = cfg(MambaCacheMode::All, 0);
    c.max_num_seqs = 2;
    c.mamba_block_size = 16; // (no token below lands on a grid boundary)
    let mut s = Scheduler::new(&c, 64, 16, 7).unwrap();
    s.add_request(NewRequest::new("a", (1..=5).collect(), 10))
        .unwrap();
    // a prefill row: the next step's rows depend on it only through the token it samples, but
    // the plan needs a step of decode rows
    let o = s.schedule().unwrap();
    assert_eq!(s.schedule_ahead(&o).unwrap(), None);
    s.update_from_output(&o, &[7], &[1], None).unwrap();
    let o = s.schedule().unwrap();
    let mut p = s
        .schedule_ahead(&o)
        .unwrap()
        .expect("a step of decode rows is planned ahead");
    assert_eq!(s.planned_step(), Some(p.step_id));
    assert_eq!(
        (p.positions.clone(), p.num_computed_tokens.clone()),
        (vec![6], vec![6])
    );
    // another step may not be scheduled while the one in flight is open; confirming before its
    // update is refused
    assert!(s.confirm_ahead(&mut p).is_err());
    // a request that arrives while the step runs, with room to run it: the plan is discarded, and
    // the step that admits it is scheduled as usual
    s.add_request(NewRequest::new("b", vec![2, 3], 4)).unwrap();
    s.update_from_output(&o, &[8], &[1], None).unwrap();
    assert_eq!(s.confirm_ahead(&mut p).unwrap(), None);
    assert_eq!(s.planned_step(), None);
    let o = s.schedule().unwrap();
    assert_eq!(ids(&o), ["a", "b"]);
    assert_eq!(s.schedule_ahead(&o).unwrap(), None, "b's prefill row");
    s.update_from_output(&o, &[9, 4], &[1, 1], None).unwrap();
    // both decode: planned, and confirmed with the tokens just sampled
    let o = s.schedule().unwrap();
    let mut p = s.schedule_ahead(&o).unwrap().unwrap();
    s.update_from_output(&o, &[10, 5], &[1, 1], None).unwrap();
    let patch = s.confirm_ahead(&mut p).unwrap().expect("confirmed");
    assert_eq!(
        (patch.input_ids.clone(), patch.dead_rows.clone()),
        (vec![10, 5], vec![])
    );
    patch.apply_to(&mut p).unwrap();
    assert_eq!(s.in_flight_step(), Some(p.step_id));
    // the same step a synchronous schedule makes from the same state
    let mut twin = Scheduler::new(&c, 64, 16, 7).unwrap();
    twin.add_request(NewRequest::new("a", (1..=5).collect(), 10))
        .unwrap();
    let t = twin.schedule().unwrap();
    twin.update_from_output(&t, &[7], &[1], None).unwrap();
    let t = twin.schedule().unwrap();
    twin.update_from_output(&t, &[8], &[1], None).unwrap();
    twin.add_request(NewRequest::new("b", vec![2, 3], 4))
        .unwrap();
    let t = twin.schedule().unwrap();
    twin.update_from_output(&t, &[9, 4], &[1, 1], None).unwrap();
    let t = twin.schedule().unwrap();
    twin.update_from_output(&t, &[10, 5], &[1, 1], None)
        .unwrap();
    let t = twin.schedule().unwrap();
    let arrays = |o: &SchedulerOutput| {
        (
            o.input_ids.clone(),
            o.positions.clone(),
            o.slot_mapping.clone(),
            o.block_table.clone(),
            o.state_read_slot.clone(),
            o.state_write_slots.clone(),
            o.seq_lens.clone(),
            o.rows.clone(),
        )
    };
    assert_eq!(arrays(&p), arrays(&t));
    // b's next token ends it by length (max_tokens 4): no row for it in the step after
    let q = s.schedule_ahead(&p).unwrap().unwrap();
    assert_eq!(ids(&q), ["a", "b"]);
    s.update_from_output(&p, &[11, 6], &[1, 1], None).unwrap();
    let q2 = s.schedule().unwrap(); // (discards q)
    let r = s.schedule_ahead(&q2).unwrap().unwrap();
    assert_eq!(
        ids(&r),
        ["a"],
        "b's last token is sampled in the running step"
    );
    // a token that lands on a grid boundary: its state is published by a copy before the next
    // step, so that step is scheduled once the update has found it (M = 8 here)
    let mut s = Scheduler::new(&cfg(MambaCacheMode::All, 0), 64, 16, 7).unwrap();
    s.add_request(NewRequest::new("a", (1..=6).collect(), 10))
        .unwrap();
    let o = s.schedule().unwrap();
    s.update_from_output(&o, &[7], &[1], None).unwrap();
    let o = s.schedule().unwrap(); // computes token 7 (position 6)
    assert!(s.schedule_ahead(&o).unwrap().is_some());
    s.update_from_output(&o, &[8], &[1], None).unwrap();
    let o = s.schedule().unwrap(); // computes the 8th token: the state after it is published
    assert_eq!(s.schedule_ahead(&o).unwrap(), None);
    // a request its EOS ends in the running step: its planned row writes nothing that is read,
    // and the confirmed step names it among the finished
    let mut s = Scheduler::new(&c, 64, 16, 7).unwrap();
    s.add_request(NewRequest::new("a", (1..=5).collect(), 10))
        .unwrap();
    let mut e = NewRequest::new("e", (1..=6).collect(), 10);
    e.stop.eos_token_id = Some(2);
    s.add_request(e).unwrap();
    let o = s.schedule().unwrap();
    s.update_from_output(&o, &[7, 8], &[1, 1], None).unwrap();
    let o = s.schedule().unwrap();
    let mut p = s.schedule_ahead(&o).unwrap().unwrap();
    let (e_slot, e_pos) = (p.state_write_slots[1], p.positions[1] as usize);
    assert_ne!(e_slot, 0);
    let deltas = s.update_from_output(&o, &[9, 2], &[1, 1], None).unwrap();
    assert!(deltas[1].finished && deltas[1].stop_token_id == Some(2));
    let patch = s.confirm_ahead(&mut p).unwrap().unwrap();
    assert_eq!(patch.dead_rows, vec![1]);
    assert_eq!(p.finished_req_ids, vec!["e".to_string()]);
    patch.apply_to(&mut p).unwrap();
    assert_eq!(p.input_ids[0], 9);
    assert_eq!(p.write_slots_row(1), &[0]);
    assert_eq!(p.slot_mapping[1], (e_pos % c.block_size) as i64);
    assert_eq!(p.block_table_row(1)[e_pos / c.block_size], 0);
    // speculation: never planned ahead (the drafts come with the tokens)
    let mut s = Scheduler::new(&cfg(MambaCacheMode::All, 2), 64, 16, 7).unwrap();
    s.add_request(NewRequest::new("a", (1..=5).collect(), 10))
        .unwrap();
    let o = s.schedule().unwrap();
    s.update_from_output(&o, &[7], &[1], None).unwrap();
    let o = s.schedule().unwrap();
    assert_eq!(s.schedule_ahead(&o).unwrap(), None);
}

#[test]
fn a_row_planned_ahead_for_a_request_an_eos_ended_leaves_its_last_state_to_the_next_turn() {
    // t1 ends by its EOS token while the step after is planned with a row for it: that row runs
    // writing only the null block and slot, so the state after t1's last computed token, kept
    // for the next turn, is intact when t2 (t1's tokens and more) hits it (the Sim checks the
    // state a hit reads).
    for mode in CHECKPOINT_MODES {
        let mut sim = Sim::new(cfg_branch(mode, 0, EvictionPolicy::Flops), 256, 64, 11);
        sim.plan_ahead = true;
        let prompt: Vec<u32> = (1..=10).collect();
        let probe = Sim::new(cfg_branch(mode, 0, EvictionPolicy::Flops), 256, 64, 11);
        let mut first = SimReq {
            prompt: prompt.clone(),
            out: Vec::new(),
            max_tokens: 12,
            eos: None,
            finished: None,
            ph: vec![H0],
            last_end: 0,
            residency: 0,
            drafts: Vec::new(),
            steps_waited: 0,
        };
        let greedy = probe.expected_output(&first);
        first.eos = Some(greedy[7]); // the 8th token ends it (if it is not also an earlier one)
        let stop_at = greedy.iter().position(|&t| Some(t) == first.eos).unwrap();
        sim.add("t1", prompt, 12, first.eos);
        // (a step whose every row is of an ended request is not run: another request runs on)
        sim.add("other", (30..=40).collect(), 30, None);
        sim.run_to_end(200);
        assert_eq!(sim.reqs["t1"].out.len(), stop_at + 1);
        assert_eq!(sim.reqs["t1"].finished, Some(FinishReason::Stop));
        assert!(
            sim.dead_rows >= 1,
            "{mode:?}: t1 had a row planned past its EOS ({} planned, {stop_at})",
            sim.planned_steps
        );
        let st = next_turn(&mut sim);
        assert_eq!(st.checkpoints_kept, 3);
        // t1 computed its prompt and every output token but the EOS
        assert_eq!(st.prefix_hit_tokens, (10 + stop_at) as u64, "{mode:?}");
        assert_eq!(st.prefix_hits_by_kind, [0, 0, 1, 0]);
    }
}
