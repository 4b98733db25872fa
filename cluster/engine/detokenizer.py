"""Incremental detokenization with stop strings, never emitting half a UTF-8 character.

Byte-level BPE tokens can end in the middle of a multi-byte character; decoding such a prefix
yields U+FFFD. Like vLLM's ``detokenize_incrementally``, we decode a short window of recent
tokens and emit only once the text no longer ends in U+FFFD. A few prompt tokens seed the window
so SentencePiece-style leading spaces come out right. Text that could still become a stop string
is held back until it cannot.
"""

from __future__ import annotations

_WINDOW_SEED = 5  # prompt tokens that seed the decoding window


class IncrementalDetokenizer:
    """Turns a request's output token ids into text deltas.

    Args:
        tokenizer: a transformers tokenizer.
        prompt_token_ids: the request's prompt.
        stop: stop strings; the output ends before the first one and excludes it.
        skip_special_tokens: drop special tokens (EOS, chat markers) from the text.
        min_tokens: stop strings are looked for only once the output has more tokens than this
            (vLLM's ``min_tokens`` rule).
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, min_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.stop = list(stop or [])
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.skip_special_tokens = skip_special_tokens
        self.token_ids = list(prompt_token_ids[-_WINDOW_SEED:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""          # all output text decoded so far (truncated at a stop string)
        self.emitted = 0        # characters of self.text already returned
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> None:
        """Append one token; sets ``stopped`` when a stop string appeared."""
        if self.stopped:
            return
        self.num_output_tokens += 1
        self.token_ids.append(token_id)
        prefix = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        new_text = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        search_from = max(0, len(self.text) - self.hold)
        self.text += new_text
        if self.num_output_tokens <= self.min_tokens:
            return
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
                search_from = min(search_from, at)

    def delta(self, final: bool) -> str:
        """Text not returned yet; while not ``final``, the last characters that could start a stop
        string are held back."""
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self.hold)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
