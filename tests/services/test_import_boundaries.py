"""The layers' house rules, checked rather than kept by care: common/ and kernels/ never
import services/, and the light roles (router, tokenizer, client SDK, CLI, simulator)
never load torch, at import or when they run."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from services.client import Client
from services.local_cluster import REPO, child_env


def _imported_modules(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside functions."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


@pytest.mark.parametrize("package", ["common", "kernels"])
def test_lower_layers_never_import_services(package):
    offenders = {str(path.relative_to(REPO)): sorted(m for m in _imported_modules(path)
                                                     if m == "services" or m.startswith("services."))
                 for path in (REPO / package).rglob("*.py")}
    assert {path: modules for path, modules in offenders.items() if modules} == {}


LIGHT_RUN = """
import sys
from click.testing import CliRunner
import services.client, services.router.main, services.tokenizer.main, services.tokenizer.openai_api
from services.cli import main
result = CliRunner().invoke(main, ["sim", "--workload", "toolbench", "--workers", "2", "--num-requests", "20",
                                   "--profile", "a6000/mistral-7b", "--policy", "e2,lpm", "--json"])
assert result.exit_code == 0, result.output
loaded = sorted(name for name in sys.modules if name == "torch" or name.startswith("torch."))
print(len(loaded), loaded[:3])
"""


def test_the_sdk_cli_roles_and_simulator_run_without_torch():
    done = subprocess.run([sys.executable, "-c", LIGHT_RUN], capture_output=True, text=True, cwd=REPO,
                          timeout=300, env=child_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[0] == "0", done.stdout


def _holds_torch(pid: int) -> bool:
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


def test_a_serving_router_and_tokenizer_hold_no_torch_but_a_worker_does(cluster):
    with Client(cluster.sdk, timeout_s=60) as client:
        assert client.generate("light roles", max_tokens=2).token_ids  # every role has done its work
    with urllib.request.urlopen(f"{cluster.http}/health", timeout=5) as response:
        tokenizer_pid = json.loads(response.read())["pid"]
    assert not _holds_torch(cluster.router_health()["pid"])
    assert not _holds_torch(tokenizer_pid)
    assert _holds_torch(cluster.worker_health(0)["pid"])  # the check can see torch where it is
