"""deploy/ against the code it deploys (no engines, no docker: files only).

The recipe (deploy/compose.yaml, deploy/k8s/*.yaml, the Dockerfiles, the frontend's
voicebot config) is checked against what runs it: the voicebot configs load with our
typed config; every ``voicebot`` command line parses with our own argparse parser
(and the config it names loads, and passes the exposure check with the environment
the container gets); readiness probes ask /healthz on the port the config serves;
vLLM servers run with prefix caching and the priority policy; the router, parsed by
vllm-router's own parser, uses the policy docs/scaling.md names, and the header that
doc names is the one the remote backend sends; the grace period covers the drain.

Each check returns its problems; ``test_each_check_fails_on_a_broken_copy`` breaks a
copy of deploy/ (and the doc) in a temporary directory for every check and sees it fail.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from vllm_router.launch_router import parse_router_args

from voicebot.cli import build_parser
from voicebot.config import Config, load_config
from voicebot.engines.llm.remote import SESSION_HEADER
from voicebot.errors import ConfigError
from voicebot.server.edge import check_exposure

ROOT = Path(__file__).resolve().parents[2]
VLLM_IMAGE = "vllm/vllm-openai"
# The flags docs/scaling.md requires of every vLLM server of the tier.
VLLM_FLAGS = {"--enable-prefix-caching": None, "--scheduling-policy": "priority"}


# ------------------------------------------------------------------- reading deploy/
@dataclass
class Image:
    """What a Dockerfile of deploy/ builds: its entrypoint, its RUN command lines, where
    its files come from (image path -> repo path), the ports it exposes."""

    path: Path
    entrypoint: list[str] = field(default_factory=list)
    runs: list[list[str]] = field(default_factory=list)
    copies: list[tuple[str, str]] = field(default_factory=list)  # (repo source, image destination)
    workdir: str = "/"
    exposed: list[int] = field(default_factory=list)

    def source_of(self, image_path: str) -> str | None:
        """The repo path a file of the image was copied from (the last COPY wins)."""
        target = PurePosixPath(self.workdir, image_path)
        for src, dst in reversed(self.copies):
            dest = PurePosixPath(self.workdir, dst)
            if target == dest:
                return src
            if dest in target.parents:
                return str(PurePosixPath(src, target.relative_to(dest)))
        return None


def read_dockerfile(path: Path) -> Image:
    image = Image(path)
    text = re.sub(r"\\\n", " ", path.read_text())  # continuation lines
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "ENTRYPOINT":
            image.entrypoint = json.loads(rest)  # exec form: SIGTERM must reach the process
        elif word == "RUN":
            for part in rest.split("&&"):
                image.runs.append(shlex.split(part))
        elif word == "COPY":
            *srcs, dst = shlex.split(rest)
            image.copies += [(s, dst) for s in srcs]
        elif word == "WORKDIR":
            image.workdir = rest.strip()
        elif word == "EXPOSE":
            image.exposed += [int(p) for p in rest.split()]
    return image


@dataclass
class Container:
    """One container of the recipe, from compose or Kubernetes, in one shape."""

    where: str  # e.g. "compose.yaml: frontend"
    image: str  # an image name, or the Dockerfile a compose service builds
    argv: list[str]  # entrypoint + command as the container runs them
    env: set[str]
    probes: list[tuple[str, int | str]]  # (path, port) of its readiness/health checks
    grace_s: float | None
    ports: dict[str, int] = field(default_factory=dict)  # k8s named container ports


def _seconds(value: Any) -> float:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(ms|s|m)?", str(value).strip())
    assert m, f"a duration: {value!r}"
    return float(m[1]) * {"ms": 0.001, "s": 1, "m": 60, None: 1}[m[2]]


def _url_probe(test: list[str] | str) -> tuple[str, int] | None:
    m = re.search(r"https?://[^/:'\"]+:(\d+)(/[\w/]*)", " ".join(test) if isinstance(test, list) else test)
    return (m[2], int(m[1])) if m else None


def _words(value: Any) -> list[str]:
    if value is None:
        return []
    return shlex.split(value) if isinstance(value, str) else [str(v) for v in value]


@dataclass
class Recipe:
    root: Path
    images: dict[str, Image]  # by Dockerfile path relative to root ("deploy/Dockerfile.frontend")
    compose: dict[str, Any]
    k8s: list[dict[str, Any]]
    containers: list[Container]
    problems: list[str]  # what could not even be read

    def of(self, role: str) -> list[Container]:
        """Containers running ``role``: "frontend", "router" or "vllm"."""
        return [c for c in self.containers if role_of(c.image) == role]

    def image_of(self, c: Container) -> Image | None:
        """The Dockerfile of deploy/ that builds ``c``'s image."""
        return self.images.get(f"deploy/Dockerfile.{role_of(c.image)}")


def role_of(image: str) -> str:
    """What an image runs: vLLM's own image, or one of deploy/'s Dockerfiles (compose builds
    deploy/Dockerfile.X; Kubernetes pulls it as REGISTRY/voicebot-X or voicebot-vllm-X)."""
    if image.startswith(VLLM_IMAGE):
        return "vllm"
    m = re.search(r"Dockerfile\.(\w+)$|voicebot-(?:vllm-)?(\w+)", image)
    return (m[1] or m[2]) if m else ""


def read_recipe(root: Path) -> Recipe:
    problems: list[str] = []
    deploy = root / "deploy"
    images = {str(p.relative_to(root)): read_dockerfile(p) for p in sorted(deploy.glob("Dockerfile.*"))}
    compose: dict[str, Any] = {}
    k8s: list[dict[str, Any]] = []
    try:
        compose = yaml.safe_load((deploy / "compose.yaml").read_text())
    except yaml.YAMLError as exc:
        problems.append(f"compose.yaml does not parse: {exc}")
    if not isinstance(compose, dict) or not isinstance(compose.get("services"), dict):
        problems.append("compose.yaml: no services mapping")
        compose = {"services": {}}
    for path in sorted((deploy / "k8s").glob("*.yaml")):
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        except yaml.YAMLError as exc:
            problems.append(f"{path.name} does not parse: {exc}")
            continue
        for d in docs:
            if not (isinstance(d, dict) and d.get("apiVersion") and d.get("kind") and d.get("metadata", {}).get("name")):
                problems.append(f"{path.name}: a document without apiVersion/kind/metadata.name: {str(d)[:80]}")
                continue
            k8s.append(d)

    containers: list[Container] = []
    for name, svc in compose["services"].items():
        build = svc.get("build") or {}
        image = build.get("dockerfile") if build else svc.get("image", "")
        built = images.get(str(image)) if build else None
        entry = _words(svc["entrypoint"]) if "entrypoint" in svc else (built.entrypoint if built else [])
        # A service without a command runs its image's ENTRYPOINT (+ CMD: none of ours has one).
        argv = entry + _words(svc.get("command"))
        check = svc.get("healthcheck", {}).get("test")
        probe = _url_probe(check) if check else None
        containers.append(Container(
            f"compose.yaml: {name}", str(image), argv, set(svc.get("environment") or {}),
            [probe] if probe else [], _seconds(svc["stop_grace_period"]) if "stop_grace_period" in svc else None))
    for d in k8s:
        pod = d.get("spec", {}).get("template", {}).get("spec")
        if d["kind"] not in ("Deployment", "StatefulSet") or not pod:
            continue
        for c in pod.get("containers", []):
            built = images.get(f"deploy/Dockerfile.{role_of(c['image'])}")
            entry = _words(c["command"]) if "command" in c else (built.entrypoint if built else [])
            probes: list[tuple[str, int | str]] = []
            for kind in ("readinessProbe", "startupProbe"):
                get = c.get(kind, {}).get("httpGet")
                if get:
                    probes.append((get["path"], get["port"]))
            containers.append(Container(
                f"{d['metadata']['name']} ({d['kind']}): {c['name']}", c["image"], entry + _words(c.get("args")),
                {e["name"] for e in c.get("env", [])}, probes, pod.get("terminationGracePeriodSeconds"),
                {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}))
    return Recipe(root, images, compose, k8s, containers, problems)


def voicebot_configs(root: Path) -> list[Path]:
    """The voicebot configs of deploy/: every YAML file but compose's, Kubernetes' and
    the monitoring's (Prometheus, Grafana)."""
    out = []
    for path in sorted((root / "deploy").rglob("*.y*ml")):
        if "monitoring" in path.relative_to(root).parts:
            continue
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            if path.name != "compose.yaml" and "k8s" not in path.parts:
                out.append(path)  # a broken config is still one: load_config says what is wrong
            continue
        if len(docs) == 1 and isinstance(docs[0], dict) and not {"services", "apiVersion"} & set(docs[0]):
            out.append(path)
    return out


def served_config(recipe: Recipe, c: Container) -> tuple[Config | None, list[str]]:
    """The config a frontend container's ``voicebot serve`` loads, and what is wrong on the way."""
    image = recipe.image_of(c)
    argv = c.argv[1:] if c.argv[:1] == ["voicebot"] else []
    try:
        args = build_parser().parse_args(argv)
    except SystemExit:
        return None, [f"{c.where}: `{shlex.join(c.argv)}` is not a voicebot command line"]
    if args.command != "serve":
        return None, [f"{c.where}: runs `{shlex.join(c.argv)}`, not voicebot serve"]
    source = image.source_of(args.config) if image else None
    if source is None or not (recipe.root / source).is_file():
        return None, [f"{c.where}: --config {args.config} is no file the image copies from the repo"]
    overrides = list(args.overrides) + ([f"server.port={args.port}"] if args.port else [])
    try:
        return load_config(recipe.root / source, overrides), []
    except ConfigError as exc:
        return None, [f"{c.where}: {exc}"]


def doc_contract(root: Path) -> dict[str, str]:
    """What docs/scaling.md's affinity contract and drain table name."""
    text = (root / "docs" / "scaling.md").read_text()
    header = re.search(r"\*\*Header\.\*\*.*?`([\w-]+): <session id>`", text, re.S)
    policy = re.search(r"\*\*Policy\.\*\*\s+vllm-router `--policy (\w+)`", text)
    margin = re.search(r"= `drain_timeout_s` \+ (\d+) s", text)
    assert header and policy and margin, "docs/scaling.md no longer says the header, policy or grace margin"
    return {"header": header[1], "policy": policy[1], "grace_margin_s": margin[1]}


# ------------------------------------------------------------------------ checks
def check_configs_load(recipe: Recipe) -> list[str]:
    problems = []
    configs = voicebot_configs(recipe.root)
    if not configs:
        problems.append("no voicebot config under deploy/")
    for path in configs:
        try:
            load_config(path)
        except ConfigError as exc:
            problems.append(str(exc))
    return problems


def check_manifests_parse(recipe: Recipe) -> list[str]:
    problems = list(recipe.problems)
    if not recipe.k8s:
        problems.append("no Kubernetes manifest under deploy/k8s")
    for want in ("frontend", "router", "vllm"):
        if not any(c.where.startswith("compose") for c in recipe.of(want)):
            problems.append(f"compose.yaml runs no {want}")
        if not any(not c.where.startswith("compose") for c in recipe.of(want)):
            problems.append(f"the Kubernetes manifests run no {want}")
    return problems


def check_voicebot_command_lines(recipe: Recipe) -> list[str]:
    """Every ``voicebot`` command line of the recipe parses with our CLI, and a serve's
    config loads and may bind its address with the environment the container gets."""
    problems = []
    lines = [(str(img.path.relative_to(recipe.root)), argv) for img in recipe.images.values()
             for argv in img.runs if argv[:1] == ["voicebot"]]
    for img in recipe.images.values():
        for src, _ in img.copies:
            if not (recipe.root / src).exists():
                problems.append(f"{img.path.name}: COPY {src}: no such path in the repo")
        for argv in img.runs:
            if argv[:1] == ["voicebot"]:
                for i, word in enumerate(argv[:-1]):  # files the command reads come from COPY
                    if word == "--config" and not (img.source_of(argv[i + 1]) and (
                            recipe.root / str(img.source_of(argv[i + 1]))).is_file()):
                        problems.append(f"{img.path.name}: `{shlex.join(argv)}`: {argv[i + 1]} is not copied")
    for c in recipe.of("frontend"):
        lines.append((c.where, c.argv))
        cfg, wrong = served_config(recipe, c)
        problems += wrong
        if cfg is not None:
            env = dict.fromkeys(c.env, "set-by-the-deployment")
            try:
                check_exposure(cfg, env)
            except ConfigError as exc:
                problems.append(f"{c.where}: {exc}")
            if cfg.llm.backend == "remote" and cfg.llm.remote.api_key_env not in c.env:
                problems.append(f"{c.where}: no {cfg.llm.remote.api_key_env} for the LLM tier's key")
    if not lines:
        problems.append("no voicebot command line found")
    for where, argv in lines:
        try:
            build_parser().parse_args(argv[1:])
        except SystemExit:
            problems.append(f"{where}: `{shlex.join(argv)}` does not parse with voicebot's CLI")
    return problems


def check_readiness_probes(recipe: Recipe) -> list[str]:
    problems = []
    for c in recipe.of("frontend"):
        cfg, _ = served_config(recipe, c)
        if cfg is None:
            problems.append(f"{c.where}: no config to check its probes against")
            continue
        if not c.probes:
            problems.append(f"{c.where}: no readiness probe")
        for path, port in c.probes:
            number = c.ports.get(port, port) if isinstance(port, str) else port
            if path != "/healthz" or number != cfg.server.port:
                problems.append(f"{c.where}: probe {path} on port {port} ({number}); the config serves "
                                f"/healthz on {cfg.server.port}")
        image = recipe.image_of(c)
        if image and cfg.server.port not in image.exposed:
            problems.append(f"{image.path.name}: EXPOSE {image.exposed}, the config serves {cfg.server.port}")
    return problems


def _flag(argv: list[str], name: str) -> str | None | bool:
    """The value of ``name`` in ``argv`` (None: a flag without a value; False: absent)."""
    for i, word in enumerate(argv):
        if word == name:
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return None if not nxt or nxt.startswith("--") else nxt
        if word.startswith(name + "="):
            return word.split("=", 1)[1]
    return False


def check_vllm_server_args(recipe: Recipe) -> list[str]:
    problems = []
    servers = recipe.of("vllm")
    if not servers:
        problems.append("no vLLM server in the recipe")
    for c in servers:
        for name, want in VLLM_FLAGS.items():
            got = _flag(c.argv, name)
            if got is False or got != want:
                problems.append(f"{c.where}: {name} {want or ''} missing (got {got!r})")
    return problems


def vllm_urls(recipe: Recipe, compose: bool) -> list[str]:
    """The URLs the recipe's vLLM servers answer on, as the router reaches them."""
    if compose:
        return [f"http://{name}:{_flag(_words(svc.get('command')), '--port')}"
                for name, svc in recipe.compose["services"].items() if str(svc.get("image", "")).startswith(VLLM_IMAGE)]
    urls = []
    for d in recipe.k8s:
        pod = d.get("spec", {}).get("template", {}).get("spec", {})
        if d["kind"] == "StatefulSet" and any(c["image"].startswith(VLLM_IMAGE) for c in pod.get("containers", [])):
            port = _flag(next(c for c in pod["containers"] if c["image"].startswith(VLLM_IMAGE)).get("args", []), "--port")
            name, service = d["metadata"]["name"], d["spec"]["serviceName"]
            urls += [f"http://{name}-{i}.{service}:{port}" for i in range(d["spec"].get("replicas", 1))]
    return urls


def check_router(recipe: Recipe) -> list[str]:
    problems = []
    contract = doc_contract(recipe.root)
    if contract["header"].lower() != SESSION_HEADER.lower():
        problems.append(f"docs/scaling.md names {contract['header']}, the remote backend sends {SESSION_HEADER}")
    routers = recipe.of("router")
    if not routers:
        problems.append("no vllm-router in the recipe")
    for c in routers:
        argv = c.argv[1:] if c.argv[:1] == ["vllm-router"] else c.argv
        try:
            args = parse_router_args(argv)
        except SystemExit:
            problems.append(f"{c.where}: `{shlex.join(argv)}` does not parse with vllm-router's own parser")
            continue
        if args.policy != contract["policy"]:
            problems.append(f"{c.where}: --policy {args.policy}; docs/scaling.md names {contract['policy']}")
        servers = vllm_urls(recipe, compose=c.where.startswith("compose"))
        if sorted(args.worker_urls) != sorted(servers):
            problems.append(f"{c.where}: --worker-urls {args.worker_urls}; the recipe's vLLM servers are {servers}")
    for c in recipe.of("frontend"):
        cfg, _ = served_config(recipe, c)
        if cfg is None or cfg.llm.backend != "remote":
            continue
        url = re.fullmatch(r"https?://([\w.-]+):(\d+)/?", cfg.llm.remote.url)
        if not url:
            problems.append(f"{c.where}: llm.remote.url {cfg.llm.remote.url} names no host:port")
            continue
        host, port = url[1], int(url[2])
        if c.where.startswith("compose"):
            router = recipe.compose["services"].get(host)
            ok = router is not None and _flag(_words(router.get("command")), "--port") == str(port)
        else:
            ok = any(d["kind"] == "Service" and d["metadata"]["name"] == host and any(
                p.get("port") == port for p in d["spec"].get("ports", [])) and recipe.of("router") for d in recipe.k8s)
        if not ok:
            problems.append(f"{c.where}: llm.remote.url {cfg.llm.remote.url} is not the router's service and port")
    return problems


def check_grace_covers_drain(recipe: Recipe) -> list[str]:
    problems = []
    margin = float(doc_contract(recipe.root)["grace_margin_s"])
    for c in recipe.of("frontend"):
        cfg, _ = served_config(recipe, c)
        if cfg is None:
            problems.append(f"{c.where}: no config to check its grace period against")
        elif c.grace_s is None or c.grace_s < cfg.server.drain_timeout_s + margin:
            problems.append(f"{c.where}: grace {c.grace_s} s < server.drain_timeout_s {cfg.server.drain_timeout_s} s "
                            f"+ {margin:g} s (docs/scaling.md): SIGKILL would cut the drain")
    return problems


# What a frontend sets for itself; every other key of configs/default.yaml (its tuned
# turn-taking, streaming ASR and replies) must be the same in the frontend's config, which
# is a file of its own: a key it leaves out takes the built-in default instead.
FRONTEND_OWN = ("server.", "asr.workers", "llm.max_num_seqs", "llm.block_size", "llm.cpu_threads_bind",
                "llm.dtype", "llm.max_model_len", "llm.kv_cache_space_gib", "llm.enforce_eager", "tts.workers")


def check_frontend_tuned_like_default(recipe: Recipe) -> list[str]:
    problems = []
    default_yaml = recipe.root / "configs" / "default.yaml"
    default = load_config(default_yaml)

    def leaves(tree: dict[str, Any], prefix: str = "") -> list[str]:
        out = []
        for key, value in tree.items():
            out += leaves(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}"]
        return out

    def get(cfg: Any, path: str) -> Any:
        for part in path.split("."):
            cfg = getattr(cfg, part)
        return cfg

    tuned = [p for p in leaves(yaml.safe_load(default_yaml.read_text())) if not p.startswith(FRONTEND_OWN)]
    for c in recipe.of("frontend"):
        cfg, _ = served_config(recipe, c)
        if cfg is None:
            continue  # configs_load reports why
        for path in tuned:
            if get(cfg, path) != get(default, path):
                problems.append(f"{c.where}: {path} is {get(cfg, path)!r}; configs/default.yaml has {get(default, path)!r}")
    return problems


CHECKS: dict[str, Callable[[Recipe], list[str]]] = {
    "configs_load": check_configs_load,
    "manifests_parse": check_manifests_parse,
    "voicebot_command_lines": check_voicebot_command_lines,
    "readiness_probes": check_readiness_probes,
    "vllm_server_args": check_vllm_server_args,
    "router": check_router,
    "grace_covers_drain": check_grace_covers_drain,
    "frontend_tuned_like_default": check_frontend_tuned_like_default,
}


# ------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", CHECKS)
def test_deploy_passes(name: str) -> None:
    assert CHECKS[name](read_recipe(ROOT)) == []


def test_the_recipe_has_what_the_checks_look_at() -> None:
    # The checks are only as good as what they find: both recipes, all three tiers.
    recipe = read_recipe(ROOT)
    assert len(recipe.of("frontend")) == 2 and len(recipe.of("router")) == 2
    assert len(recipe.of("vllm")) >= 3  # compose vllm-0, vllm-1 and the StatefulSet
    assert voicebot_configs(ROOT) == [ROOT / "deploy" / "frontend.yaml"]
    assert len([a for img in recipe.images.values() for a in img.runs if a[:1] == ["voicebot"]]) == 1  # models pull


def _sub(path: str, old: str, new: str) -> Callable[[Path], None]:
    def edit(root: Path) -> None:
        p = root / path
        text = p.read_text()
        assert old in text, f"{path}: {old!r} not found (the breakage no longer applies)"
        p.write_text(text.replace(old, new, 1))
    return edit


# Breakages of what the deployment relies on, each with the check that must catch it.
BREAKAGES: list[tuple[str, str, Callable[[Path], None]]] = [
    ("configs_load", "unknown backend", _sub("deploy/frontend.yaml", "backend: remote", "backend: remotely")),
    ("manifests_parse", "a tab in k8s", _sub("deploy/k8s/voicebot.yaml", "  replicas: 2\n", "  replicas: 2\n\t bad: [\n")),
    ("voicebot_command_lines", "--cfg", _sub("deploy/Dockerfile.frontend", '"serve", "--config"', '"serve", "--cfg"')),
    ("voicebot_command_lines", "no such sub-command", _sub("deploy/Dockerfile.frontend", "voicebot models pull",
                                                           "voicebot models fetch")),
    ("voicebot_command_lines", "COPY of a missing path", _sub("deploy/Dockerfile.frontend", "COPY web web", "COPY webs web")),
    ("readiness_probes", "config port", _sub("deploy/frontend.yaml", "port: 8080", "port: 9090")),
    ("readiness_probes", "k8s probe path", _sub(
        "deploy/k8s/voicebot.yaml", "readinessProbe:            # 200 only when ASR, TTS and the LLM tier answer; "
        "503 draining\n            httpGet: {path: /healthz", "readinessProbe:\n            httpGet: {path: /health")),
    ("vllm_server_args", "no prefix caching", _sub("deploy/k8s/voicebot.yaml", "- --enable-prefix-caching\n", "")),
    ("vllm_server_args", "fcfs", _sub("deploy/compose.yaml", "--scheduling-policy priority", "--scheduling-policy fcfs")),
    ("router", "compose policy", _sub("deploy/compose.yaml", "--policy sticky_least_loaded", "--policy cache_aware")),
    ("router", "k8s policy typo", _sub("deploy/k8s/voicebot.yaml", "--policy=sticky_least_loaded", "--policy=sticky")),
    ("router", "a third server not routed", _sub("deploy/k8s/voicebot.yaml", "replicas: 2\n  podManagementPolicy",
                                                 "replicas: 3\n  podManagementPolicy")),
    ("router", "llm url", _sub("deploy/frontend.yaml", "url: http://vllm-router:8000", "url: http://router:8000")),
    ("grace_covers_drain", "longer drain", _sub("deploy/frontend.yaml", "drain_timeout_s: 30", "drain_timeout_s: 40")),
    ("frontend_tuned_like_default", "silence turns", _sub("deploy/frontend.yaml", "turn_detector: smart_turn\n", "")),
]


@pytest.fixture
def copy(tmp_path: Path) -> Path:
    """deploy/ and docs/scaling.md copied, what the Dockerfiles COPY linked."""
    shutil.copytree(ROOT / "deploy", tmp_path / "deploy")
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "docs" / "scaling.md", tmp_path / "docs")
    for src in ("pyproject.toml", "README.md", "constraints", "voicebot", "models", "configs", "web"):
        (tmp_path / src).symlink_to(ROOT / src)
    return tmp_path


def test_every_check_has_a_breakage() -> None:
    assert {name for name, _, _ in BREAKAGES} == set(CHECKS)


@pytest.mark.parametrize(("name", "edit"), [(n, e) for n, _, e in BREAKAGES], ids=[f"{n}-{w}" for n, w, _ in BREAKAGES])
def test_each_check_fails_on_a_broken_copy(name: str, edit: Callable[[Path], None], copy: Path) -> None:
    assert CHECKS[name](read_recipe(copy)) == [], "the unbroken copy passes"
    edit(copy)
    assert CHECKS[name](read_recipe(copy)), f"{name} did not notice the breakage"
