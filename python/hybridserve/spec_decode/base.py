"""The proposer interface: what the engine asks a drafter for each step."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class Proposals:
    """Drafts per row, and the distribution each draft token was sampled from when known.

    `draft_probs[i]` is a [len(draft_token_ids[i]), V] tensor (or None for that row); the whole
    field is None for drafters without probabilities (n-gram, greedy draft models), which the
    rejection sampler treats as one-hot drafts.
    """

    draft_token_ids: list[list[int]]
    draft_probs: list[torch.Tensor | None] | None = None


@dataclass(frozen=True, slots=True)
class History:
    """One row's token history as the engine holds it: the prompt, the output so far (the
    request's own list, which only grows while the request lives) and the tokens this step
    emitted (not in the output yet). A proposer that keeps a request's history between steps adds
    only what is new; the others take `tokens()` or `tokens_from(start)`."""

    prompt: Sequence[int]
    output: Sequence[int]
    new: Sequence[int]

    def tokens(self) -> list[int]:
        return [*self.prompt, *self.output, *self.new]

    def __len__(self) -> int:
        return len(self.prompt) + len(self.output) + len(self.new)

    def tokens_from(self, start: int) -> list[int]:
        """The history's tokens from position `start` on (without building the ones before)."""
        out: list[int] = []
        for part in (self.prompt, self.output, self.new):
            if start < len(part):
                out.extend(int(t) for t in part[max(0, start) :])
            start -= len(part)
        return out


class Proposer(ABC):
    """Proposes up to k draft tokens per row from each row's full token history.

    `token_ids_per_row[i]` is row i's prompt + every accepted output token (including the token
    sampled this step). A row may get fewer than k drafts, or none.
    """

    @abstractmethod
    def propose(self, token_ids_per_row: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """Up to k drafts per row."""

    def propose_for(
        self, request_ids: Sequence[str], token_ids_per_row: Sequence[Sequence[int]], k: int
    ) -> list[list[int]]:
        """Like `propose`, for proposers that keep per-request state (draft models)."""
        return self.propose(token_ids_per_row, k)

    def propose_histories(
        self, request_ids: Sequence[str], histories: Sequence[History], k: int
    ) -> list[list[int]]:
        """`propose_for` of the rows' histories as the engine holds them (`History`)."""
        return self.propose_for(request_ids, [h.tokens() for h in histories], k)

    def propose_with_probs(
        self, request_ids: Sequence[str], token_ids_per_row: Sequence[Sequence[int]], k: int
    ) -> Proposals:
        """Drafts plus their draft distributions; proposers without probabilities return None ones."""
        return Proposals(draft_token_ids=self.propose_for(request_ids, token_ids_per_row, k))

    def free(self, request_id: str) -> None:  # noqa: B027 - a no-op default is the point
        """Forget a finished or aborted request (stateless proposers: nothing to do)."""
