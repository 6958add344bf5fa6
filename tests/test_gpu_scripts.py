"""The GPU-node scripts' refusals (workflow/scripts/gpu_node.sh, gpu_site.sh), run here: bash only, no GPU node
and no network needed."""

import os
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "workflow" / "scripts" / "gpu_node.sh"
SITE = ROOT / "workflow" / "scripts" / "gpu_site.sh"


def _run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **env}, timeout=60)


def test_wait_on_a_machine_without_a_job_says_so_at_once(tmp_path):
    """A device machine released between calls comes back bare; `wait` must not sit out its seconds."""
    job, out = tmp_path / "job", tmp_path / "out"
    t0 = time.monotonic()
    r = _run("wait", "30", GPU_NODE_JOB=str(job), OUT=str(out))
    assert r.returncode == 1 and "no job on this machine" in r.stdout
    assert time.monotonic() - t0 < 10
    # the control: a finished job is collected
    (job / "out").mkdir(parents=True)
    (job / "rc").write_text("0\n")
    (job / "log").write_text("done\n")
    r = _run("wait", "30", GPU_NODE_JOB=str(job), OUT=str(out))
    assert r.returncode == 0 and "job ended, exit 0" in r.stdout
    assert (out / "results.tar.gz").is_file()


def test_usage_errors_are_one_line_and_exit_2():
    for args in ([], ["wait", "ten"], ["frobnicate"]):
        r = _run(*args)
        assert r.returncode == 2, (args, r.stdout, r.stderr)
        assert len(r.stdout.strip().splitlines()) == 1 and r.stdout.startswith("gpu_node:"), (args, r.stdout)


def test_site_parts_too_large_to_travel_beside_the_repository_are_refused(tmp_path):
    """A device call carries 64 MiB: one part plus the repository. A part size that leaves no room is refused
    before anything is downloaded; the default passes that check (it then fails only on the bad WHAT)."""
    def site(*args):
        return subprocess.run(["bash", str(SITE), str(tmp_path / "parts"), *args], capture_output=True, text=True,
                              cwd=ROOT, timeout=60)
    r = site("60", "site")
    assert r.returncode == 2 and "PART_MIB must be at most" in r.stdout, r.stdout
    r = site("4x", "site")
    assert r.returncode == 2 and "whole number" in r.stdout
    r = site("40", "nothing")  # the default part size
    assert r.returncode == 2 and r.stdout.strip() == "gpu_site: WHAT must be all, site or rl, got nothing"


def test_vllm_job_outside_gpu_node_start_is_refused_in_one_line():
    """``gpu_vllm_job.sh`` writes into the job folder that ``gpu_node.sh start`` gives it; run bare it stops at once."""
    env = {k: v for k, v in os.environ.items() if k != "JOB_OUT"}
    r = subprocess.run(["bash", str(ROOT / "workflow" / "scripts" / "gpu_vllm_job.sh")], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=60)
    assert r.returncode != 0 and "run through gpu_node.sh start (JOB_OUT)" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_vllm_job_refuses_an_unknown_stage_before_running_any(tmp_path):
    """``STAGES`` is checked whole before the first stage starts: a typo costs no device time."""
    env = {**os.environ, "JOB_OUT": str(tmp_path), "STAGES": "vllm rlstpe"}
    r = subprocess.run(["bash", str(ROOT / "workflow" / "scripts" / "gpu_vllm_job.sh")], capture_output=True, text=True,
                       cwd=ROOT, env=env, timeout=60)
    assert r.returncode == 2 and "unknown stage 'rlstpe'; allowed: tests vllm rlstep leaf chunkwise" in r.stdout
    assert list(tmp_path.iterdir()) == []  # nothing ran, not even the utilisation log
