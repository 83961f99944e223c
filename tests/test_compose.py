"""The compose stack is secure by default and builds the right images, read from the files (no Docker here).

Secure by default: only the API publishes a port (on loopback unless told otherwise); Ray and Redis live on an
internal network; every Ray process (head, workers, and the drivers: the API and the solve job) runs with token
authentication, the token from the environment through a secret; Redis has a password that every REDIS_URL
carries; the API is started with keys. Compose's own ``${VAR:?message}`` interpolation is what refuses to start
without them, so the file is interpolated here the way compose does it, with and without each variable.
Images: the GPU workers build the CUDA variant of the one Dockerfile, the rest the CPU one."""

import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SECRETS = {"RAY_AUTH_TOKEN": "ray-token-0123", "REDIS_PASSWORD": "redis-pw-4567", "THINKPOOL_API_KEYS": "key-a,key-b:8"}
RAY_SERVICES = ("ray-head", "ray-gpu-worker", "api", "solve")  # Ray nodes and Ray drivers


class MissingVariable(Exception):
    pass


_VARIABLE = re.compile(r"\$(?:(\$)|\{([A-Za-z_]\w*)(?:(:?[-?+])([^}]*))?\}|([A-Za-z_]\w*))")


def interpolate(node, env: dict[str, str]):
    """Compose's variable interpolation: ``$$``, ``${V}``, ``${V:-default}``, ``${V-default}``, ``${V:?error}``,
    ``${V?error}``, ``${V:+alt}``, ``${V+alt}``, over every string of the file (extension fields included)."""
    if isinstance(node, dict):
        return {key: interpolate(value, env) for key, value in node.items()}
    if isinstance(node, list):
        return [interpolate(value, env) for value in node]
    if not isinstance(node, str):
        return node

    def substitute(match: re.Match) -> str:
        if match.group(1):
            return "$"
        name, op, arg = match.group(2) or match.group(5), match.group(3), match.group(4) or ""
        value = env.get(name)
        if op in (":?", "?") and (value is None or (op == ":?" and value == "")):
            raise MissingVariable(f"{name}: {arg}")
        if op == ":-":
            return value or arg
        if op == "-":
            return arg if value is None else value
        if op == ":+":
            return arg if value else ""
        if op == "+":
            return "" if value is None else arg
        return value or ""

    return _VARIABLE.sub(substitute, node)


@pytest.fixture(scope="module")
def raw():
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


@pytest.fixture(scope="module")
def compose(raw):
    return interpolate(raw, SECRETS)


@pytest.mark.parametrize("missing", sorted(SECRETS))
def test_compose_refuses_to_start_without_each_secret(raw, missing):
    for unset in ({k: v for k, v in SECRETS.items() if k != missing}, {**SECRETS, missing: ""}):
        with pytest.raises(MissingVariable, match=missing):
            interpolate(raw, unset)


def test_only_the_api_is_published_and_ray_and_redis_stay_internal(compose):
    services, networks = compose["services"], compose["networks"]
    published = {name for name, service in services.items() if service.get("ports")}
    assert published == {"api"}
    assert not any(service.get("network_mode") == "host" for service in services.values())
    for name in ("redis", "ray-head", "ray-gpu-worker", "solve"):
        assert services[name]["networks"], name
        assert all(networks[net].get("internal") is True for net in services[name]["networks"]), name
    assert "backend" in services["api"]["networks"] and networks["backend"]["internal"] is True
    (port,) = services["api"]["ports"]
    assert port == "127.0.0.1:8000:8000"  # loopback unless THINKPOOL_API_BIND says otherwise (behind a TLS proxy)
    assert "8265" not in yaml.safe_dump(services)  # the dashboard / job API is never mapped


def test_every_ray_process_authenticates_with_the_shared_token(compose):
    services, secrets = compose["services"], compose["secrets"]
    for name in RAY_SERVICES:
        service = services[name]
        env = service["environment"]
        assert env["RAY_AUTH_MODE"] == "token", name
        if "RAY_AUTH_TOKEN" in env:
            assert env["RAY_AUTH_TOKEN"] == SECRETS["RAY_AUTH_TOKEN"], name
        else:
            path = env["RAY_AUTH_TOKEN_PATH"]
            secret = path.removeprefix("/run/secrets/")
            assert path.startswith("/run/secrets/") and secret in service["secrets"], name
            assert secrets[secret] == {"environment": "RAY_AUTH_TOKEN"}, name
    ray_commands = {name: " ".join(s.get("entrypoint") or s.get("command") or []) for name, s in services.items()}
    assert {name for name, command in ray_commands.items() if command.startswith("ray ")} <= set(RAY_SERVICES)
    assert "disabled" not in yaml.safe_dump(services)


def test_redis_has_a_password_and_every_redis_url_carries_it(compose):
    from redis.connection import parse_url

    services = compose["services"]
    command = services["redis"]["command"]
    assert command[command.index("--requirepass") + 1] == SECRETS["REDIS_PASSWORD"]
    assert services["redis"]["environment"]["REDISCLI_AUTH"] == SECRETS["REDIS_PASSWORD"]  # the health check
    urls = {name: s["environment"]["REDIS_URL"] for name, s in services.items() if "REDIS_URL" in s.get("environment", {})}
    assert {"api", "solve", "ray-gpu-worker"} <= set(urls)
    for name, url in urls.items():
        assert urlsplit(url).hostname == "redis", name
        assert parse_url(url)["password"] == SECRETS["REDIS_PASSWORD"], name  # as redis-py reads it


def test_the_api_is_started_with_keys(compose):
    from orchestrator.api import parse_keys

    env = compose["services"]["api"]["environment"]
    assert env["THINKPOOL_API_KEYS"] == SECRETS["THINKPOOL_API_KEYS"]
    assert set(parse_keys(env["THINKPOOL_API_KEYS"])) == {"key-a", "key-b"}


def test_workers_build_the_cuda_image_and_the_rest_the_cpu_one(compose):
    services = compose["services"]
    device = {name: s["build"]["args"]["DEVICE"] for name, s in services.items() if "build" in s}
    assert device == {"ray-head": "cpu", "ray-gpu-worker": "cuda", "api": "cpu", "solve": "cpu"}
    assert services["ray-gpu-worker"]["image"] != services["api"]["image"]  # two tags, not one overwritten
    (gpu,) = services["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"] and gpu["count"] == 1
    assert "deploy" not in services["api"]  # the API needs no GPU


def test_the_dockerfile_selects_torch_by_device_and_uses_only_declared_arguments(compose):
    lines = [line for line in (ROOT / "Dockerfile").read_text().splitlines() if not line.lstrip().startswith("#")]
    text = "\n".join(lines)
    declared = {m.group(1) for m in re.finditer(r"^(?:ARG|ENV)\s+(\w+)", text, re.M)}
    declared |= {name for env in re.findall(r"^ENV\s+(.*)$", text, re.M) for name in re.findall(r"(\w+)=", env)}
    used = set(re.findall(r"\$\{?([A-Za-z_]\w*)", text))
    assert used <= declared, f"used but never declared: {sorted(used - declared)}"
    assert re.search(r"^ARG DEVICE=cpu$", text, re.M)
    run = text.replace("\\\n", "")
    assert re.search(r"cpu\)\s+pip install [^;]*torch==\$\{TORCH_VERSION\}[^;]*--index-url \"\$TORCH_CPU_INDEX\"", run)
    assert "cuda)" in run and "torch.version.cuda" in run  # the build checks that torch matches DEVICE
    for service in compose["services"].values():
        assert set(service.get("build", {}).get("args", {})) <= declared


def test_every_long_running_service_comes_back_after_a_crash(compose):
    services = compose["services"]
    assert {name for name, service in services.items() if service.get("restart") == "unless-stopped"} == \
        {"redis", "ray-head", "ray-gpu-worker", "api"}  # not the one-off solve
