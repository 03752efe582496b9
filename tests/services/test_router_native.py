"""The router's compiled modules (services/router/native.py): loaded only from a finished
build of the current sources, never with BATON_NATIVE_ROUTER=0, and deciding exactly as
the sources do."""
from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

from services.local_cluster import REPO, child_env
from services.router import native
from tests.services.test_bench_router import DIGESTS, TINY


def test_only_a_finished_build_of_these_sources_is_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(sys, "path", list(sys.path))
    package_path = ["/the/sources"]
    assert not native.use_compiled("services.router", package_path)  # nothing built here
    folder = native.build_folder()
    assert folder.parent == tmp_path / "router-native"
    (folder / "services" / "router").mkdir(parents=True)  # a build that did not finish
    assert not native.use_compiled("services.router", package_path) and package_path == ["/the/sources"]
    (folder / native.COMPLETE).write_text("")
    monkeypatch.setenv("BATON_NATIVE_ROUTER", "0")
    assert not native.use_compiled("services.router", package_path)
    monkeypatch.setenv("BATON_NATIVE_ROUTER", "1")
    assert native.use_compiled("services.router", package_path)
    assert package_path == [str(folder / "services" / "router"), "/the/sources"]
    assert str(folder) not in sys.path  # which child processes inherit: see the spawn test below


needs_compiler = pytest.mark.skipif(
    importlib.util.find_spec("mypyc") is None or not (shutil.which("cc") or shutil.which("gcc")),
    reason="compiling needs mypyc (mypy) and a C compiler")


@needs_compiler
def test_the_compiled_modules_load_and_decide_as_the_sources_do():
    from services.router.native_build import build

    build()  # the cache's build of these sources: seconds if scripts/_venv.sh made it already
    probe = ("import services.router.index, services.router.cluster, services.router.admission, "
             "services.router.policies.cost_aware as m; import sys; "
             "print(*(sys.modules[name].__file__ for name in ('services.router.index', 'services.router.cluster', "
             "'services.router.admission', 'services.router.policies.cost_aware')))")
    bench = [sys.executable, str(REPO / "scripts" / "bench_router.py"), *TINY, "--policies", "e2,cost_aware", "--json"]
    for setting, suffix in (("1", ".so"), ("0", ".py")):
        env = child_env(BATON_NATIVE_ROUTER=setting)
        loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=env, cwd=REPO,
                                timeout=60)
        assert loaded.returncode == 0, loaded.stderr
        assert [path.endswith(suffix) for path in loaded.stdout.split()] == [True] * 4, loaded.stdout
        done = subprocess.run(bench, capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
        assert done.returncode == 0, done.stderr
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert {name: row["decisions_digest"] for name, row in result.items()} == \
            {name: DIGESTS[name] for name in ("e2", "cost_aware")}
        assert [row["compiled"] for row in result.values()] == [setting == "1"] * 2  # and the bench says which ran


SPAWN_PROBE = """
import concurrent.futures, multiprocessing, pkgutil
try:
    from services.router import native
except ImportError:
    native = None
if __name__ == "__main__" and native is None:
    print("not installed")
elif __name__ == "__main__":
    assert native.compiled()
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        make_policy = pool.submit(pkgutil.resolve_name, "services.router.policies:make_policy").result()
        print(pool.submit(native.compiled).result(), make_policy.__module__)
"""


@needs_compiler
def test_a_spawned_child_of_a_compiled_router_finds_the_sources_and_the_build(tmp_path):
    """A spawned process starts with its parent's sys.path: the build must not be on it,
    or a child that finds the sources through the installed package (not on sys.path)
    finds the build's services/ tree first, as a package without them (svc sim --jobs
    spawns its runs so)."""
    from services.router.native_build import build

    build()
    env = child_env(BATON_NATIVE_ROUTER="1")
    env.pop("PYTHONPATH")  # as `svc` runs: the sources found by the install, not by a path
    done = subprocess.run([sys.executable, "-c", SPAWN_PROBE], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    if done.stdout.split() == ["not", "installed"]:
        pytest.skip("the project is not installed in this Python (pip install -e .)")
    assert done.stdout.split() == ["True", "services.router.policies"]
