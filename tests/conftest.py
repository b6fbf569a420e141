"""Shared fixtures: one small upcycled MoE made by the RL harness's own recipe, once per session."""

from __future__ import annotations

import pytest

# trained long enough that every fault recipe's bracket holds its critical knob (the recipes'
# brackets were fixed on the 300-step grid models; a 60-step model's router collapses at any knob)
RL_MODEL_STEPS = 150


@pytest.fixture(scope="session")
def rl_model(tmp_path_factory):
    pytest.importorskip("transformers")
    from planner.rl.models import ModelRecipe, make_model

    out = tmp_path_factory.mktemp("rl") / "qwen3_moe"
    report = make_model("qwen3_moe", out, ModelRecipe(dense_steps=RL_MODEL_STEPS, moe_steps=RL_MODEL_STEPS))
    return out, report


def _postgres_bin():
    import shutil
    from pathlib import Path

    found = shutil.which("pg_ctl")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"))
    return versions[-1].parent if versions else None


@pytest.fixture(scope="module")
def postgres_url():
    """A real PostgreSQL server for the module: initdb in a temp folder, started on a free loopback
    port with pg_ctl, stopped (and its folder removed) afterwards. PostgreSQL refuses to run as root,
    so as root it runs as the `postgres` user. Skipped, with the reason, where it cannot start."""
    import os
    import shutil
    import socket
    import subprocess
    import tempfile
    from pathlib import Path

    pytest.importorskip("psycopg2", reason="no PostgreSQL driver (pip install psycopg2-binary)")
    bindir = _postgres_bin()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl): Debian's postgresql package provides them (.ci/run installs it)")
    root = Path(tempfile.mkdtemp(prefix="planner-pg-"))
    as_user: list[str] = []
    if os.geteuid() == 0:
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            shutil.rmtree(root)
            pytest.skip("running as root and there is no `postgres` user to run the server as")
        os.chown(root, user.pw_uid, user.pw_gid)
        as_user = ["runuser", "-u", "postgres", "--"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data, log = root / "data", root / "server.log"

    def run(*cmd):
        return subprocess.run([*as_user, *map(str, cmd)], capture_output=True, text=True, timeout=120)

    made = run(bindir / "initdb", "-D", data, "-A", "trust", "-U", "planner", "--no-sync")
    started = made.returncode == 0 and run(bindir / "pg_ctl", "-D", data, "-l", log, "-w", "-t", "60", "-o",
                                           f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off", "start").returncode == 0  # fmt: skip
    if not started:
        reason = (made.stderr or "").strip().splitlines()[-1:] or (log.read_text().strip().splitlines()[-1:] if log.exists() else ["?"])
        shutil.rmtree(root, ignore_errors=True)
        pytest.skip(f"PostgreSQL did not start: {reason[0]}")
    try:
        yield f"postgresql+psycopg2://planner@127.0.0.1:{port}/postgres"
    finally:
        run(bindir / "pg_ctl", "-D", data, "-m", "fast", "-w", "stop")
        shutil.rmtree(root, ignore_errors=True)
