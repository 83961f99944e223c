"""Project files that a fresh machine and a deployment rely on."""

import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_pyproject_declares_the_cli_and_the_four_packages():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["name"] == "thinkpool"
    assert project["project"]["scripts"]["thinkpool"] == "orchestrator.cli:main"
    for package in ("orchestrator", "workers", "dms_runtime", "policies"):
        assert (ROOT / package / "__init__.py").is_file()
    deps = " ".join(project["project"]["dependencies"])
    for name in ("torch", "transformers", "kvpress", "ray", "langgraph", "redis", "pydantic"):
        assert name in deps


def test_readme_opens_with_the_two_setup_commands_and_ci_runs_the_test_one():
    lines = (ROOT / "README.md").read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert block[0].startswith("bash scripts/setup.sh && .venv/bin/thinkpool solve")
    assert block[1].startswith("bash scripts/test.sh")
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_compose_services_point_at_real_entry_points():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "ray-head", "ray-gpu-worker", "api", "solve"} <= set(services)
    from orchestrator.cli import build_parser

    args = build_parser().parse_args(services["solve"]["command"])
    assert args.command == "solve" and args.samples == 8
    api = [part.replace("${THINKPOOL_WORKERS:-1}", "1") for part in services["api"]["command"]]
    args = build_parser().parse_args(api)
    assert args.command == "serve" and args.port == 8000 and args.host == "0.0.0.0"
    assert services["api"]["environment"]["REDIS_URL"].endswith("@redis:6379/0")
    assert services["api"]["environment"]["RAY_ADDRESS"] == "ray-head:6379"
    assert "--port=6379" in services["ray-head"]["entrypoint"]
    gpu = services["ray-gpu-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpu["capabilities"] == ["gpu"] and "ray-head:6379" in " ".join(services["ray-gpu-worker"]["entrypoint"])
    for name in ("redis", "ray-head", "api"):
        assert "healthcheck" in services[name]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for package in ("orchestrator", "workers", "dms_runtime", "policies", "tasks", "configs", "checkpoints"):
        assert f"COPY {package} {package}" in dockerfile
