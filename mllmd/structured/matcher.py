"""One request's grammar state: which tokens its next step may take, advanced by each token it took."""

from __future__ import annotations

from typing import Any

import torch


class RequestGrammar:
    """An xgrammar matcher, inactive until `starts_after_token` (a reasoning block's end) was emitted.

    `stop_token_ids`: the tokens that end the reply (the engine's EOS ids); once the grammar is
    complete they are the only tokens allowed."""

    def __init__(self, compiled: Any, stop_token_ids: list[int], starts_after_token: int | None = None) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids) or None)
        self.active = starts_after_token is None
        self._starts_after = starts_after_token
        self.rejected = False  # a token the grammar refused reached it (a bug upstream; the request ends)

    @property
    def constrains(self) -> bool:
        """Whether the next token is masked."""
        return self.active and not self.rejected and not self._matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advance by the token the request took; False if the grammar refuses it."""
        if not self.active:
            if token == self._starts_after:
                self.active = True
            return True
        if self._matcher.is_terminated():
            return True
        if not self._matcher.accept_token(token):
            self.rejected = True
            return False
        return True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row `row` of an int32 bitmask [R, ceil(V / 32)] gets the allowed next tokens."""
        self._matcher.fill_next_token_bitmask(bitmask, row)
