"""What ``Handle`` (HT) and ``LLHandle`` share: the backend state one handle owns, freed once."""

from __future__ import annotations


class BackendHandle:
    """Owns one backend state of ``group`` (the routing of ``num_tokens`` tokens, top-``topk``).
    ``destroy()`` frees it once, also when the handle is collected; any use after that raises."""

    def __init__(self, group, state, num_tokens: int, topk: int):
        self.group, self._state = group, state
        self.num_tokens, self.topk = num_tokens, topk

    def _before_destroy(self) -> None:
        """What a handle type settles before its state is freed (the backend is still alive)."""

    def destroy(self) -> None:
        if self._state is not None and self.group._backend is not None:
            self._before_destroy()
            self.group._backend.destroy_handle(self._state)
        self._state = None

    def _require_alive(self) -> None:
        if self._state is None:
            raise RuntimeError(f"this {type(self).__name__} was destroyed")
        self.group._require_alive()

    def __del__(self):
        try:
            self.destroy()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
