"""Shared fixtures.

Environment:
- ``VOICEBOT_CACHE``: cache folder for downloads, built models and test data
  (default: ``ModelsConfig().cache_dir``, i.e. ``~/.cache/voicebot``). Point it at an
  empty folder to test a cold start; the bundle rebuilds itself there.
- ``HF_HUB_OFFLINE`` is forced to 1: tests never reach the Hugging Face hub.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import pytest
from speech import Clip, load_clips

from voicebot.config import ModelsConfig
from voicebot.errors import VoicebotError
from voicebot.provision import pull

if TYPE_CHECKING:
    from servers import EnginePool

# Before any test imports transformers / huggingface_hub, which read it at import.
os.environ["HF_HUB_OFFLINE"] = "1"

# Under pytest-xdist each test process pins its vLLM engines (in-process, or servers it
# starts) to a core of its own; vLLM's "auto" would put every process's engine on the
# same first core and leave the other to the rest.
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
if _worker.startswith("gw") and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cores[int(_worker[2:]) % len(_cores)])


@pytest.fixture(scope="session")
def models_config() -> ModelsConfig:
    """models.* settings for tests: the shared cache (or ``$VOICEBOT_CACHE``), offline."""
    cache = os.environ.get("VOICEBOT_CACHE") or ModelsConfig().cache_dir
    return ModelsConfig(cache_dir=cache, offline=True)


_POOLS: list[EnginePool] = []  # the engine_pool of this test process, once made
_POOLED = pytest.StashKey[set[str]]()  # the modules whose tests use it


@pytest.fixture(scope="session")
async def engine_pool() -> AsyncIterator[EnginePool]:
    """Engines shared by the in-process servers of this test process (tests/servers.py)."""
    from servers import EnginePool

    pool = EnginePool()
    _POOLS.append(pool)
    yield pool
    _POOLS.remove(pool)
    await pool.aclose()


@pytest.fixture(scope="module", autouse=True)
async def _pool_released_for_other_modules(request: pytest.FixtureRequest) -> None:
    """A module that uses no pooled server runs without the pool's engines in memory (an
    LLM's processes take GBs, beside the engines or servers the module starts itself)."""
    if _POOLS and request.node.nodeid not in request.config.stash.get(_POOLED, set()):
        await _POOLS[0].aclose()


@pytest.fixture(scope="session")
def speech_clips(models_config: ModelsConfig) -> list[Clip]:
    """Six real English utterances (16 kHz float32) with reference transcripts.

    Fails, never skips, when the data cannot be fetched: a test suite that silently
    skips its speech tests would pass without testing anything.
    """
    try:
        clips = load_clips(models_config)
    except Exception as exc:
        pytest.fail(f"speech_clips: cannot provide test speech: {exc}", pytrace=False)
    assert len(clips) == 6, [c.name for c in clips]
    return clips


@pytest.fixture(scope="session")
def bundle_dir(models_config: ModelsConfig) -> Callable[[str], str]:
    """``bundle_dir("NAME")``: the built directory of a bundle entry, built on first use.

    Fails (never skips) when it cannot be built, with the BundleError's one-line fix.
    """

    def get(name: str) -> str:
        try:
            return str(pull([name], models_config, log=lambda _: None, verify=False)[name])
        except VoicebotError as exc:
            pytest.fail(f"bundle:{name}: {exc}", pytrace=False)

    return get


@pytest.fixture(scope="session")
def tokenizer(bundle_dir: Callable[[str], str]):  # type: ignore[no-untyped-def]
    """The Qwen3 tokenizer the fake engines (tests/fakes.py) count and render prompts with."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(bundle_dir("qwen3-tokenizer"))


@pytest.fixture(scope="session")
def whisper_tiny_dir(bundle_dir: Callable[[str], str]) -> str:
    return bundle_dir("whisper-tiny.en")


# The longest modules first, so that under pytest-xdist (`make test`: a module per process
# at a time) the two processes finish together instead of one running the soak alone at
# the end: the modules with servers of their own by decreasing time, then the modules
# whose in-process servers borrow engines from the process's pool (tests/servers.py),
# grouped by the LLM they run so that each process starts each LLM once (the pool keeps
# one), then the other modules with a real engine, then the fast tier, whose short
# modules fill the last gaps. xdist hands the modules out in this order only with
# --no-loadscope-reorder (the Makefile passes it): by default it reorders them by their
# number of tests, the most first, which put the one-test soak last. Order only: every
# test still runs.
_FIRST = (
    "e2e/test_soak.py",
    "e2e/test_lifecycle.py",
    "e2e/test_scale_out.py",
    # configs/test.yaml's random Qwen3
    "e2e/test_telemetry_e2e.py",
    "e2e/test_short_utterance.py",
    "transports/test_twilio.py",
    "e2e/test_web.py",
    "services/test_asr_service_e2e.py",
    "transports/test_realtime.py",
    "services/test_tts_service_e2e.py",
    "e2e/test_coqui_call.py",
    "transports/test_webrtc.py",
    # configs/default.yaml's LLM (servers.cpu_default_llm): one process runs these three
    "e2e/test_voice_loop.py",
    "e2e/test_tools_e2e.py",
    "e2e/test_clients_realtime.py",
    "engines/test_llm_shutdown.py",
)
# Modules that xdist runs in one process, one after the other (a group is one unit of
# work, as a module is otherwise): they borrow one LLM from the process's pool, which two
# processes would each start (~50 s).
_TOGETHER = {
    "e2e/test_voice_loop.py": "cpu-default-llm",
    "e2e/test_tools_e2e.py": "cpu-default-llm",
    "e2e/test_clients_realtime.py": "cpu-default-llm",
}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist, absent with -p no:xdist
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`--dist loadfile` (the Makefile's), with the modules of ``_TOGETHER`` as one unit.
    (xdist's own `--dist loadgroup` marks tests by renaming them, which this pytest's
    node ids do not show.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesAndGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return next((group for tail, group in _TOGETHER.items() if path.endswith(tail)), path)

    return ModulesAndGroups(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    def module(item: pytest.Item) -> str:
        return item.nodeid.split("::", 1)[0]

    with_engines = {module(item) for item in items if item.get_closest_marker("engines")}
    config.stash[_POOLED] = {module(item) for item in items if "engine_pool" in item.fixturenames}

    def rank(item: pytest.Item) -> int:
        path = module(item)
        listed = next((i for i, first in enumerate(_FIRST) if path.endswith(first)), None)
        if listed is not None:
            return listed
        return len(_FIRST) + (path not in with_engines)

    items.sort(key=rank)  # stable: within a rank, modules and tests keep their order
