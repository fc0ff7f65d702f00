"""The FastConformer's settings that need no model: CUDA graphs are refused where they
cannot run, and the row counts its steps are padded to."""

from __future__ import annotations

import pytest

from voicebot.config import load_config
from voicebot.engines.asr.fastconformer_model import step_buckets
from voicebot.errors import ConfigError


def test_cuda_graphs_on_the_cpu_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="cuda_graphs needs asr.fastconformer.device: cuda"):
        load_config(None, ["asr.backend=fastconformer", "asr.fastconformer.cuda_graphs=true"])
    cfg = load_config(None, ["asr.fastconformer.device=cuda", "asr.fastconformer.cuda_graphs=true"])
    assert cfg.asr.fastconformer.cuda_graphs


@pytest.mark.parametrize(("slots", "buckets"), [
    (1, [1]),
    (2, [1, 2]),
    (5, [1, 2, 3, 4, 5]),
    (64, [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]),
    (100, [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 100]),
])
def test_steps_are_padded_to_powers_of_two_and_halfway_points(slots: int, buckets: list[int]) -> None:
    assert step_buckets(slots) == buckets
