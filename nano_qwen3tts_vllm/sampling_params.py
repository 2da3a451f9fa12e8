from __future__ import annotations

from dataclasses import dataclass, fields

# Upstream's fallbacks when generation_config.json leaves a value out.
HARD_DEFAULTS = dict(
    do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
    subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9,
    max_new_tokens=2048,
)


@dataclass
class SamplingParams:
    """Per-request generation settings, named as in qwen-tts.

    The talker (codebook 0) uses do_sample/temperature/top_k/top_p/repetition_penalty;
    the code predictor (codebooks 1..15) uses the subtalker_* settings.
    `seed` makes sampling reproducible whatever else is batched with the request.
    """
    do_sample: bool = True
    temperature: float = 0.9
    top_k: int = 50
    top_p: float = 1.0
    repetition_penalty: float = 1.05
    subtalker_dosample: bool = True
    subtalker_temperature: float = 0.9
    subtalker_top_k: int = 50
    subtalker_top_p: float = 1.0
    max_new_tokens: int = 2048
    min_new_tokens: int = 2
    seed: int | None = None

    @classmethod
    def from_defaults(cls, generation_config: dict | None = None, **overrides) -> "SamplingParams":
        """User value if not None, else generation_config.json's, else upstream's hard default."""
        gen = generation_config or {}
        values = {}
        for f in fields(cls):
            user = overrides.pop(f.name, None)
            if user is not None:
                values[f.name] = user
            elif f.name in gen and f.name in HARD_DEFAULTS:
                values[f.name] = gen[f.name]
            elif f.name in HARD_DEFAULTS:
                values[f.name] = HARD_DEFAULTS[f.name]
        if overrides:
            raise TypeError(f"unknown generation arguments: {sorted(overrides)}")
        return cls(**values)

    def validate(self, max_new_tokens_limit: int) -> None:
        """Raise ValueError naming the first bad setting."""
        for prefix, sample, temp, k, p in (("", self.do_sample, self.temperature, self.top_k, self.top_p),
                                           ("subtalker_", self.subtalker_dosample, self.subtalker_temperature,
                                            self.subtalker_top_k, self.subtalker_top_p)):
            if sample and not temp > 0:
                raise ValueError(f"{prefix}temperature must be > 0 when sampling, got {temp} "
                                 f"(use {prefix or ''}do_sample=False for greedy)")
            if int(k) != k or k < 0:
                raise ValueError(f"{prefix}top_k must be an integer >= 0, got {k}")
            if not 0 < p <= 1:
                raise ValueError(f"{prefix}top_p must be in (0, 1], got {p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if int(self.max_new_tokens) != self.max_new_tokens or not 1 <= self.max_new_tokens <= max_new_tokens_limit:
            raise ValueError(f"max_new_tokens must be an integer in [1, {max_new_tokens_limit}], "
                             f"got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")
        if self.seed is not None and (int(self.seed) != self.seed or not 0 <= self.seed < 2**63):
            raise ValueError(f"seed must be an integer in [0, 2**63), got {self.seed}")
