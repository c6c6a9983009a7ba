"""The mock engines' model of a request: its prompt length, its KV blocks, its timings.

There are no real requests. A handoff's prompt length is `prompt_tokens(handoff_id, ...)`, a pure
function of the handoff id, so the source and the destination agree on it without extra wire
fields; engine processes that serve the same handoffs need the same prompt range.

    Source (prefill) engine
    SubmitPrefill  -> Submitted; wait for KV blocks and a slot; prefill for
                      tokens / prefill_tokens_per_s; then SourceHeld(timing)
    StartTransfer  -> Scheduled; after delay_ms, TransferCompleted (the blocks stay held)
    ReleaseSource  -> Applied, freeing the blocks; Noop if nothing was held
    CancelSource   -> Applied, freeing the blocks or withdrawing the waiting request; else Noop

    Destination (decode) engine
    ReserveDestination  -> Accepted; wait for KV blocks and a slot; then DestinationReserved with
                           the prompt rounded down to whole blocks (only full blocks transfer)
    ActivateDestination -> Applied; the decode runs for decode_ms and then frees the blocks
    CancelDestination   -> Applied, freeing the blocks (ending a running decode) or withdrawing
                           the waiting reservation; else Noop

Every modelled duration (prefill, transfer, decode) is divided by `speedup`. An invalid model
raises `ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhandoff.events.ids import HandoffId
from kvhandoff.events.messages import HandoffTransferTiming, KvTransferTimingMode
from kvhandoff.worker.errors import ConfigError


def prompt_tokens(handoff_id: HandoffId, shortest: int, longest: int) -> int:
    """The prompt length the mock gives a handoff: its id folded into [shortest, longest].

    The one function both roles derive it from, so the source's `SourceHeld` and the
    destination's reservation describe the same prompt. A UUID4's low bits are random, so the
    lengths spread evenly over the range.
    """
    return shortest + handoff_id.int % (longest - shortest + 1)


@dataclass(frozen=True)
class EngineModel:
    """The capacity and the timings of every mock engine in a process."""

    block_size: int = 16
    kv_blocks: int = 8192
    max_slots: int = 64
    shortest_prompt: int = 128
    longest_prompt: int = 2048
    prefill_tokens_per_s: float = 20_000.0
    decode_ms: float = 200.0
    # Llama-3-8B in fp16: 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes.
    kv_bytes_per_token: int = 131_072
    bandwidth_gb_s: float = 25.0
    timing_mode: KvTransferTimingMode = KvTransferTimingMode.FULL_PROMPT
    speedup: float = 1.0

    def __post_init__(self) -> None:
        positive = {
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks,
            "max_slots": self.max_slots,
            "shortest_prompt": self.shortest_prompt,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "speedup": self.speedup,
        }
        for name, value in positive.items():
            if not value > 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if self.longest_prompt < self.shortest_prompt:
            raise ConfigError(f"prompt range {self.shortest_prompt}:{self.longest_prompt} is empty")
        if self.decode_ms < 0 or self.kv_bytes_per_token < 0 or self.bandwidth_gb_s < 0:
            raise ConfigError("decode_ms, kv_bytes_per_token and bandwidth_gb_s must be >= 0")

    def prompt_of(self, handoff_id: HandoffId) -> int:
        return prompt_tokens(handoff_id, self.shortest_prompt, self.longest_prompt)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def transferable_tokens(self, tokens: int) -> int:
        """The prompt tokens in whole blocks: a partial last block is recomputed, not moved."""
        return tokens // self.block_size * self.block_size

    def timing(self, tokens: int) -> HandoffTransferTiming:
        return HandoffTransferTiming(
            mode=self.timing_mode,
            full_prompt_tokens=tokens,
            kv_bytes_per_token=self.kv_bytes_per_token,
            bandwidth_gb_s=self.bandwidth_gb_s,
        )

    def prefill_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s / self.speedup

    def transfer_s(self, delay_ms: float) -> float:
        return delay_ms / 1000.0 / self.speedup

    def decode_s(self) -> float:
        return self.decode_ms / 1000.0 / self.speedup
