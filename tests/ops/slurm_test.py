#!/usr/bin/env python3
"""End-to-end test of deploy/slurm/ on a real one-node Slurm (tests/ops/slurm_cluster.sh).

Jobs run as a non-root user made for the test, so the prolog's switch to the job's user is
exercised. Cases: a 2-rank job that checkpoints every iteration; scancel in mid-run (every
version commits and verifies or is absent for readers, and no daemon, shared memory, socket
directory or .tmp is left); a resubmitted job resumes from `latest`, byte-exact; two jobs of
one user at once, each with its own daemon; a broken config and a missing root fail the
prolog with a message (the node drains; the test resumes it); an epilog never signals a
process the prolog did not record. Every wait polls with a deadline.

Usage: slurm_test.py BUILD_DIR [CASE...] (CASE: a case_* name without the prefix). Exit 77 (ctest SKIP_RETURN_CODE) when the machine cannot
host the cluster, saying why.
"""
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import time

SKIP = 77
HERE = os.path.dirname(os.path.abspath(__file__))
CLUSTER = os.path.join(HERE, "slurm_cluster.sh")
D = os.environ.get("CKPTD_SLURM_DIR", "/tmp/ckptd-slurm")
EPILOG = f"{D}/libexec/ckptd/epilog.sh"  # the copy slurm_cluster.sh installed
USER = "ckptd-test"
SLURM_ENV = dict(os.environ, SLURM_CONF=f"{D}/etc/slurm.conf")
HOST = subprocess.run(["hostname", "-s"], capture_output=True, text=True).stdout.strip()


def skip(why):
    print(f"SKIP: {why}")
    sys.exit(SKIP)


def run(cmd, check=True, env=SLURM_ENV, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}: {p.stdout}{p.stderr}")
    return p


def eventually(what, fn, limit=90):
    deadline = time.monotonic() + limit
    while True:
        v = fn()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit} s waiting for {what}")
        time.sleep(0.2)


def job_field(job, field):
    out = run(["scontrol", "-o", "show", "job", str(job)], check=False).stdout
    m = re.search(rf"\b{field}=(\S*)", out)
    return m.group(1) if m else None


def node_state():
    return run(["sinfo", "-h", "-n", HOST, "-o", "%T"]).stdout.strip()


def node_idle():
    return node_state() == "idle"


def as_user(cmd):
    return ["setpriv", f"--reuid={USER}", f"--regid={USER}", "--init-groups", "--"] + cmd


def sbatch(name, script, ntasks=2):
    path = f"{D}/jobs/{name}.sh"
    with open(path, "w") as f:
        f.write("#!/bin/bash\nset -euo pipefail\n" + script)
    os.chmod(path, 0o755)
    out = run(as_user(["env", f"SLURM_CONF={D}/etc/slurm.conf", "sbatch", "--parsable", f"-n{ntasks}",
                       f"--job-name={name}", f"--output={D}/jobs/{name}.out", f"--chdir={D}/jobs", path])).stdout
    return int(out.strip().split(";")[0])


def wait_done(job, limit=120):
    """Waits until the job has ended and its epilog has run (the node is idle again)."""
    eventually(f"job {job} to end", lambda: job_field(job, "JobState") in
               ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"), limit)
    eventually(f"the epilog of job {job} (node idle)", node_idle, limit)
    return job_field(job, "JobState"), job_field(job, "ExitCode")


def exit_status(proc, limit):
    """The process's exit status, or None if it still runs after `limit` seconds."""
    try:
        return proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        return None


def output(name):
    with open(f"{D}/jobs/{name}.out") as f:
        return f.read()


class Env:
    def __init__(self):
        # The copies slurm_cluster.sh installed, which the job's user can reach.
        self.trainer = f"{D}/bin/ckpt-toy-trainer"
        self.ckptd = os.path.realpath(f"{D}/bin/ckptd")
        self.ckptctl = f"{D}/bin/ckptctl"
        self.uid = pwd.getpwnam(USER).pw_uid
        self.root = f"{D}/ckpt/{USER}"

    def train(self, job, extra, iters):
        return (f"export LD_LIBRARY_PATH={D}/lib\n"
                f"srun -n2 bash -c 'exec {self.trainer} --socket \"$CKPTD_SOCKET\" --job {job} "
                f"--rank $SLURM_PROCID --world-size $SLURM_NTASKS --state-mib 8 --tensors 4 "
                f"--iters {iters} --compute-ms 20 {extra}'\n")

    def committed(self, job):
        d = f"{self.root}/{job}"
        if not os.path.isdir(d):
            return []
        return sorted(int(v[1:]) for v in os.listdir(d)
                      if v.startswith("v") and os.path.exists(f"{d}/{v}/COMMITTED"))

    def daemons(self):
        """ckptd processes of the test user, by pid."""
        found = []
        for p in os.listdir("/proc"):
            if not p.isdigit():
                continue
            try:
                exe = os.readlink(f"/proc/{p}/exe")
                st = os.stat(f"/proc/{p}")
            except OSError:
                continue
            if exe == self.ckptd and st.st_uid == self.uid:
                found.append(int(p))
        return found

    def assert_node_clean(self, what):
        assert not self.daemons(), f"{what}: ckptd still running: {self.daemons()}"
        shm = [f for f in os.listdir("/dev/shm") if f.startswith("ckpt-")
               and os.stat(f"/dev/shm/{f}").st_uid == self.uid]
        assert not shm, f"{what}: shared memory left in /dev/shm: {shm}"
        base = f"{D}/run/ckptd-jobs"
        left = os.listdir(base) if os.path.isdir(base) else []
        assert not left, f"{what}: left in the run base: {left}"
        tmp = [os.path.join(dp, f) for dp, _, fs in os.walk(self.root) for f in fs if f.endswith(".tmp")]
        assert not tmp, f"{what}: temporary files left: {tmp}"

    def verify_versions(self, job):
        """Every committed version's shards pass their checksums; versions without COMMITTED
        are newer than `latest` (absent for readers)."""
        d = f"{self.root}/{job}"
        with open(f"{d}/latest") as f:
            latest = int(f.read().strip().lstrip("v"))
        committed = self.committed(job)
        assert latest in committed, f"latest {latest} is not committed ({committed})"
        for v in committed:
            shards = [f"{d}/v{v:010d}/rank-{r:05d}.safetensors" for r in range(2)]
            run([self.ckptctl, "verify"] + shards)
        partial = sorted(int(v[1:]) for v in os.listdir(d) if v.startswith("v") and int(v[1:]) not in committed)
        for v in partial:
            assert v > latest, f"version {v} has no COMMITTED but is not newer than latest {latest}"
        return latest, committed, partial


def case_two_ranks(env):
    job = sbatch("two-ranks", env.train("two", "", 6))
    state, code = wait_done(job)
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job}: {state} {code}\n{output('two-ranks')}"
    out = output("two-ranks")
    m = re.search(r"daemon at (\S+)", out)
    assert m and m.group(1) == f"{D}/run/ckptd-jobs/job-{job}/ckptd.sock", out
    latest, committed, partial = env.verify_versions("two")
    assert committed == list(range(1, 7)) and latest == 6 and not partial, (latest, committed, partial)
    env.assert_node_clean("after a completed job")
    print(f"ok: job {job}, 2 ranks, versions {committed} committed and verified")


def case_scancel_and_resume(env):
    job = sbatch("cancel", env.train("resumable", "", 100000))
    eventually("3 committed versions", lambda: len(env.committed("resumable")) >= 3)
    run(["scancel", str(job)])
    state, _ = wait_done(job)
    assert state == "CANCELLED", state
    latest, committed, partial = env.verify_versions("resumable")
    env.assert_node_clean("after scancel")
    print(f"ok: scancel of job {job}: {len(committed)} versions committed and verified (latest {latest}), "
          f"{len(partial)} newer without COMMITTED; no daemon, shm, socket dir or .tmp left")

    job2 = sbatch("resume", env.train("resumable", "--resume", latest + 3))
    state, code = wait_done(job2)
    out = output("resume")
    assert (state, code) == ("COMPLETED", "0:0"), f"job {job2}: {state} {code}\n{out}"
    restored = re.findall(r"restored version (\d+) .*every byte verified", out)
    assert restored == [str(latest)] * 2, f"expected both ranks to restore {latest}: {out}"
    assert env.committed("resumable")[-1] == latest + 3
    env.verify_versions("resumable")
    env.assert_node_clean("after the resumed job")
    print(f"ok: job {job2} resumed both ranks from version {latest}, byte-exact, and went on to {latest + 3}")


def case_two_jobs(env):
    # Each job waits for the other to be running before it trains, so both daemons serve at once.
    barrier = (f"touch {D}/jobs/started-$SLURM_JOB_NAME\n"
               f"for i in $(seq 600); do [ -e {D}/jobs/started-$OTHER ] && break; sleep 0.1; done\n"
               f"[ -e {D}/jobs/started-$OTHER ]\n"
               f"ls {D}/run/ckptd-jobs > {D}/jobs/$SLURM_JOB_NAME.running\n")
    a = sbatch("conc-a", "OTHER=conc-b\n" + barrier + env.train("conc-a", "", 8))
    b = sbatch("conc-b", "OTHER=conc-a\n" + barrier + env.train("conc-b", "", 8))
    for job, name in ((a, "conc-a"), (b, "conc-b")):
        state, code = wait_done(job)
        assert (state, code) == ("COMPLETED", "0:0"), f"job {job}: {state} {code}\n{output(name)}"
        assert env.committed(name) == list(range(1, 9)), env.committed(name)
        env.verify_versions(name)
    with open(f"{D}/jobs/conc-a.running") as f:
        running = f.read().split()
    assert f"job-{a}" in running and f"job-{b}" in running, running
    env.assert_node_clean("after two concurrent jobs")
    print(f"ok: jobs {a} and {b} of one user ran at once, each with its own daemon, and both committed")


def expect_prolog_failure(env, name, message):
    job = sbatch(name, "echo should-not-run\n")
    eventually("the node to drain or the job to end",
               lambda: "drain" in node_state() or job_field(job, "JobState") == "COMPLETED")
    assert "drain" in node_state(), f"job {job} ran although its daemon could not start:\n{output(name)}"
    reason = run(["sinfo", "-h", "-R", "-o", "%E"]).stdout.strip()
    with open(f"{D}/log/ckptd/slurm-scripts.log") as f:
        log = f.read()
    lines = [ln for ln in log.splitlines() if f"prolog job {job}: FAILED" in ln]
    assert lines and re.search(message, lines[-1]), f"prolog log of job {job}: {lines}"
    # slurmd logs the prolog's output too, where an operator looks first.
    with open(f"{D}/log/slurmd.log") as f:
        slurmd_log = f.read()
    assert re.search(rf"prolog failed: rc:1 output:.*prolog job {job}: FAILED: .*{message}", slurmd_log), \
        f"slurmd.log has no failure message of job {job}"
    run(["scancel", str(job)])
    eventually(f"job {job} to end", lambda: job_field(job, "JobState") in ("CANCELLED", None))
    run(["scontrol", "update", f"nodename={HOST}", "state=resume"])
    eventually("the node to be idle again", node_idle)
    assert "should-not-run" not in (output(name) if os.path.exists(f"{D}/jobs/{name}.out") else "")
    env.assert_node_clean(f"after the failed prolog of job {job}")
    print(f"ok: {name}: the prolog failed (node reason '{reason}'): {lines[-1].split('FAILED: ')[1]}")


def case_bad_config(env):
    conf = f"{D}/etc/ckptd.conf"
    with open(conf) as f:
        good = f.read()
    try:
        with open(conf, "a") as f:
            f.write("local-keep = 0\n")
        expect_prolog_failure(env, "bad-config", r"did not start: exited with status 2.*local-keep")
    finally:
        with open(conf, "w") as f:
            f.write(good)
    # A daemon that never says ready is killed after CKPTD_READY_TIMEOUT_S.
    envfile = f"{D}/etc/ckptd.env"
    with open(envfile) as f:
        good_env = f.read()
    hang = f"{D}/bin/hang"
    with open(hang, "w") as f:
        f.write("#!/bin/sh\nexec sleep 300\n")
    os.chmod(hang, 0o755)
    try:
        with open(envfile, "a") as f:
            f.write(f"CKPTD_BIN={hang}\nCKPTD_READY_TIMEOUT_S=2\n")
        expect_prolog_failure(env, "hang", r"did not start: not ready after 2 s; killed")
        hung = []
        for p in filter(str.isdigit, os.listdir("/proc")):
            try:
                if (os.stat(f"/proc/{p}").st_uid == env.uid
                        and open(f"/proc/{p}/cmdline", "rb").read() == b"sleep\x00300\x00"):
                    hung.append(p)
            except OSError:
                pass
        assert not hung, f"the hung daemon stand-in is still running: {hung}"
    finally:
        with open(envfile, "w") as f:
            f.write(good_env)
        os.remove(hang)
    moved = env.root + ".away"
    os.rename(env.root, moved)
    try:
        expect_prolog_failure(env, "no-root", rf"checkpoint root {re.escape(env.root)} does not exist")
    finally:
        os.rename(moved, env.root)


def case_epilog_never_signals_unverified(env):
    """The epilog, given a recorded pid whose start time (or executable) differs from the
    live process's, signals nothing and removes the stale record."""
    victim = subprocess.Popen(as_user(["sleep", "300"]))
    try:
        sleep_exe = os.path.realpath(shutil.which("sleep"))
        eventually("setpriv to exec sleep", lambda: os.readlink(f"/proc/{victim.pid}/exe") == sleep_exe)
        stat = open(f"/proc/{victim.pid}/stat").read()
        start = stat.rsplit(") ", 1)[1].split()[19]
        exe = os.readlink(f"/proc/{victim.pid}/exe")
        base = f"{D}/run/ckptd-jobs"
        os.makedirs(base, mode=0o755, exist_ok=True)  # made by the first prolog otherwise
        for record in (f"{victim.pid} {int(start) + 1} {env.uid} {exe}",  # pid reused
                       f"{victim.pid} {start} {env.uid} {env.ckptd}"):  # another program
            with open(f"{base}/job-424242.pid", "w") as f:
                f.write(record + "\n")
            epilog_env = dict(SLURM_ENV, CKPTD_ENV_FILE=f"{D}/etc/ckptd.env", SLURM_JOB_ID="424242",
                              SLURM_JOB_USER=USER, SLURM_JOB_UID=str(env.uid))
            p = run(["bash", EPILOG], env=epilog_env)
            assert victim.poll() is None, f"the epilog signalled pid {victim.pid} (record '{record}')"
            assert "not signalling" in p.stderr, p.stderr
            assert not os.path.exists(f"{base}/job-424242.pid"), "stale record not removed"
    finally:
        victim.kill()
        victim.wait()
    print("ok: the epilog left a process with a mismatching start time or executable alone")


def identity(pid):
    """What the prolog records: PID START-TIME UID EXE."""
    start = open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1].split()[19]
    uid = os.stat(f"/proc/{pid}").st_uid
    return f"{pid} {start} {uid} {os.readlink(f'/proc/{pid}/exe')}"


def case_epilog_sigkill_after_timeout(env):
    """A daemon that cannot finish its shard in flight (held at the publish pause seam) gets
    CKPTD_STOP_TIMEOUT_S after SIGTERM, then SIGKILL, logged first; the epilog then removes
    its .tmp files, its socket directory and the shared memory of the SIGKILLed trainer."""
    epilog_after_held_daemon(env, "434343", died_before=False)


def case_epilog_cleans_after_dead_daemon(env):
    """A daemon that died by itself mid-flush (an OOM kill) is not signalled, but its .tmp
    files are removed all the same (before: left on the shared root for ever); a file of the
    user's in /dev/shm that merely starts with "ckpt-" is not libckpt's and stays (before: it
    was removed)."""
    epilog_after_held_daemon(env, "454545", died_before=True)


def epilog_after_held_daemon(env, job, died_before):
    base = f"{D}/run/ckptd-jobs"
    jobdir = f"{base}/job-{job}"
    envfile = f"{D}/etc/ckptd-stop2.env"
    with open(f"{D}/etc/ckptd.env") as f, open(envfile, "w") as g:
        g.write(f.read() + "CKPTD_STOP_TIMEOUT_S=2\n")
    gid = pwd.getpwnam(USER).pw_gid
    os.makedirs(base, mode=0o755, exist_ok=True)  # made by the first prolog otherwise
    os.makedirs(jobdir, mode=0o700)
    os.chown(jobdir, env.uid, gid)
    pause = f"{D}/jobs/pause-{job}"
    open(pause, "w").close()
    r, w = os.pipe()
    daemon = subprocess.Popen(
        as_user([env.ckptd, "--socket", f"{jobdir}/ckptd.sock", "--root", env.root, "--pool-mib", "64",
                 "--chunk-mib", "4", "--node-id", f"{HOST}-job{job}", "--ready-fd", str(w)]),
        pass_fds=(w,), env=dict(os.environ, CKPTD_TEST_PAUSE=f"publish:2:{pause}"),
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(w)
    assert os.read(r, 16).startswith(b"ready"), "the paused daemon did not start"
    os.close(r)
    trainer = subprocess.Popen(
        as_user(["env", f"LD_LIBRARY_PATH={D}/lib", env.trainer, "--socket", f"{jobdir}/ckptd.sock",
                 "--job", f"sigkill{job}", "--state-mib", "4", "--tensors", "2", "--iters", "2",
                 "--compute-ms", "1", "--quiet"]), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        eventually("the daemon to hold version 2 at publish", lambda: os.path.exists(pause + ".reached"))
        tmp_glob = lambda: [os.path.join(dp, f) for dp, _, fs in os.walk(env.root) for f in fs
                            if f.endswith(f".{HOST}-job{job}.tmp")]
        assert tmp_glob(), "no .tmp of the held shard"
        trainer.kill()  # Slurm has killed the job's tasks before the epilog runs
        trainer.wait()
        shm = [f for f in os.listdir("/dev/shm") if f.startswith(f"ckpt-{env.uid}-{trainer.pid}-")]
        assert shm, "the SIGKILLed trainer left no shared memory to clean (test premise)"
        with open(f"{base}/job-{job}.pid", "w") as f:
            f.write(identity(daemon.pid) + "\n")
        precious = "/dev/shm/ckpt-mydata-" + job
        with open(precious, "w") as f:
            f.write("the user's own\n")
        os.chown(precious, env.uid, gid)
        if died_before:
            daemon.kill()
            daemon.wait()
        p = run(["bash", EPILOG], env=dict(SLURM_ENV, CKPTD_ENV_FILE=envfile, SLURM_JOB_ID=job,
                                             SLURM_JOB_USER=USER, SLURM_JOB_UID=str(env.uid)))
        if died_before:
            assert "is gone" in p.stderr and "not signalling" in p.stderr, p.stderr
        else:
            assert exit_status(daemon, 5) == -9, f"the daemon was not SIGKILLed: {p.stderr}"
            assert f"did not stop within 2 s of SIGTERM; sending SIGKILL" in p.stderr, p.stderr
        assert not tmp_glob(), f"the epilog left {tmp_glob()}"
        assert os.path.exists(precious), f"the epilog removed {precious}, which is not libckpt's"
        os.remove(precious)
        assert not os.path.exists(jobdir) and not os.path.exists(f"{base}/job-{job}.pid")
        assert not any(os.path.exists(f"/dev/shm/{f}") for f in shm), f"shared memory {shm} left"
    finally:
        for proc in (trainer, daemon):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        os.remove(pause)
        os.remove(envfile)
    env.assert_node_clean("after the SIGKILL path of the epilog")
    if died_before:
        print("ok: a daemon that died mid-flush was not signalled, and its .tmp, socket dir and the killed "
              "trainer's shared memory were removed; the user's own ckpt-* file in /dev/shm stayed")
    else:
        print("ok: a daemon held mid-flush got 2 s after SIGTERM, then a logged SIGKILL; its .tmp, socket dir "
              "and the killed trainer's shared memory were removed")


def case_node_mode(env):
    """CKPTD_SLURM_MODE=node: the prolog only checks, as the job's user, that the node daemon
    answers, and the TaskProlog exports its socket; with the node daemon down the prolog
    fails the job."""
    sockdir = f"{D}/run/node"
    os.makedirs(sockdir, mode=0o755)
    node_root = f"{D}/ckpt-node"
    os.makedirs(node_root, mode=0o755)
    socket = f"{sockdir}/ckptd.sock"
    r, w = os.pipe()
    daemon = subprocess.Popen([env.ckptd, "--socket", socket, "--socket-mode", "0666", "--root", node_root,
                               "--allow-uid", str(env.uid), "--pool-mib", "64", "--chunk-mib", "4",
                               "--ready-fd", str(w)], pass_fds=(w,),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(w)
    envfile = f"{D}/etc/ckptd.env"
    with open(envfile) as f:
        good = f.read()
    try:
        assert os.read(r, 16).startswith(b"ready"), "the node daemon did not start"
        os.close(r)
        with open(envfile, "a") as f:
            f.write(f"CKPTD_SLURM_MODE=node\nCKPTD_NODE_SOCKET={socket}\nCKPTD_FINISH_JOBS='nodemode other-%j'\n")
        job = sbatch("node-mode", env.train("nodemode", "", 3))
        state, code = wait_done(job)
        out = output("node-mode")
        assert (state, code) == ("COMPLETED", "0:0"), f"job {job}: {state} {code}\n{out}"
        assert f"daemon at {socket}" in out, out
        assert all(os.path.exists(f"{node_root}/nodemode/v{v:010d}/COMMITTED") for v in (1, 2, 3))
        assert daemon.poll() is None, "the epilog stopped the node daemon"
        # The job exited 0: the epilog finished the checkpoint jobs named, and the node
        # daemon let go of nodemode's memory images (files stay); %j expanded.
        with open(f"{D}/log/ckptd/slurm-scripts.log") as f:
            log = f.read()
        assert "job nodemode finished on this node: " in log, log
        assert f"job other-{job} finished on this node: 0 memory image(s)" in log, log
        jobs = json.loads(subprocess.run([env.ckptctl, "--socket", socket, "jobs", "--json"], check=True,
                                         capture_output=True, text=True).stdout)
        held = [j for j in jobs["jobs"] if j["job"] == "nodemode"]
        assert held and int(held[0].get("memory_bytes", 0)) == 0, jobs
        daemon.terminate()
        daemon.wait()
        expect_prolog_failure(env, "node-mode-down", rf"node mode: no ckptd socket at {re.escape(socket)}")
    finally:
        with open(envfile, "w") as f:
            f.write(good)
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    print(f"ok: node mode: job {job} used the node daemon at {socket}; with it down the prolog failed the job")


def case_epilog_stops_upgraded_daemon(env):
    """A daemon whose executable was replaced on disk while the job ran (/proc/PID/exe reads
    "EXE (deleted)") is still the recorded process: the epilog stops it."""
    job = "454545"
    base = f"{D}/run/ckptd-jobs"
    jobdir = f"{base}/job-{job}"
    os.makedirs(base, mode=0o755, exist_ok=True)  # made by the first prolog otherwise
    os.makedirs(jobdir, mode=0o700)
    os.chown(jobdir, env.uid, pwd.getpwnam(USER).pw_gid)
    binary = f"{D}/bin/ckptd-old"
    shutil.copy2(env.ckptd, binary)
    r, w = os.pipe()
    daemon = subprocess.Popen(as_user([binary, "--socket", f"{jobdir}/ckptd.sock", "--root", env.root,
                                       "--pool-mib", "16", "--chunk-mib", "1", "--ready-fd", str(w)]),
                              pass_fds=(w,), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.close(w)
    try:
        assert os.read(r, 16).startswith(b"ready"), "the daemon did not start"
        os.close(r)
        with open(f"{base}/job-{job}.pid", "w") as f:
            f.write(identity(daemon.pid) + "\n")
        os.remove(binary)  # the upgrade
        p = run(["bash", EPILOG], env=dict(SLURM_ENV, CKPTD_ENV_FILE=f"{D}/etc/ckptd.env", SLURM_JOB_ID=job,
                                             SLURM_JOB_USER=USER, SLURM_JOB_UID=str(env.uid)))
        assert exit_status(daemon, 30) == 0, f"the replaced daemon was not stopped: {p.stderr}"
        assert f"ckptd pid {daemon.pid} stopped" in p.stderr, p.stderr
        assert not os.path.exists(jobdir)
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
        if os.path.exists(binary):
            os.remove(binary)
    print("ok: the epilog stopped a daemon whose executable had been replaced on disk")


def exit_on_signals():
    """SIGTERM and SIGHUP (timeout, a closed terminal) end the run as Ctrl-C does, through the
    finally of main, which stops the cluster and removes its directory and user; Python's
    default would end it at once and leave them."""
    def handler(signum, _frame):
        for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            signal.signal(s, signal.SIG_IGN)
        raise SystemExit(128 + signum)
    for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        signal.signal(s, handler)


def main():
    exit_on_signals()
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    build = os.path.abspath(sys.argv[1])
    if os.geteuid() != 0:
        skip("needs root (starts slurmctld, slurmd and munged, and adds a user)")
    for tool in ("slurmctld", "slurmd", "sbatch", "srun", "munged", "mungekey", "setpriv", "useradd"):
        if not shutil.which(tool, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin"):
            skip(f"{tool} is not installed (Debian: slurm-wlm, munge)")
    for b in ("ckptd", "ckptctl", "ckpt-toy-trainer"):
        if not os.access(os.path.join(build, b), os.X_OK):
            skip(f"{b} is not built in {build}")
    made_user = False
    try:
        pwd.getpwnam(USER)
    except KeyError:
        run(["useradd", "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent",
             "--shell", "/bin/bash", USER])
        made_user = True
    try:
        run(["bash", CLUSTER, "start", build], env=dict(os.environ, CKPTD_SLURM_DIR=D))
        env = Env()
        os.makedirs(env.root, mode=0o700)
        os.chown(env.root, env.uid, pwd.getpwnam(USER).pw_gid)
        cases = [case_two_ranks, case_scancel_and_resume, case_two_jobs, case_bad_config,
                 case_epilog_never_signals_unverified, case_epilog_sigkill_after_timeout,
                 case_epilog_cleans_after_dead_daemon, case_epilog_stops_upgraded_daemon,
                 case_node_mode]
        only = sys.argv[2:]
        for case in cases:
            if not only or case.__name__[len("case_"):] in only:
                case(env)
        print("PASS")
        return 0
    except AssertionError as e:
        print(f"FAIL: {e}")
        for f in ("log/ckptd/slurm-scripts.log", "log/slurmd.log"):
            try:
                with open(f"{D}/{f}") as fh:
                    print(f"--- {f} (tail)\n" + "".join(fh.readlines()[-30:]))
            except OSError:
                pass
        return 1
    finally:
        run(["scancel", "-u", USER], check=False)
        run(["bash", CLUSTER, "stop"], check=False, env=dict(os.environ, CKPTD_SLURM_DIR=D))
        if made_user:
            run(["userdel", USER], check=False)
        if os.environ.get("CKPTD_KEEP_TEST_DIR") != "1":
            shutil.rmtree(D, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
