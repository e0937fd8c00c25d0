"""A real local Slurm cluster for the tests: munged, slurmctld and N slurmd ("n1", "n2", ...) on loopback.

Everything (config, keys, state, logs, sockets) lives in one private directory; daemons listen on
127.0.0.1 only. Needs root and Debian's slurmctld, slurmd, slurm-client and munge (``make test``
installs them). Jobs are cancelled before the daemons stop (proctrack/linuxproc does not kill them).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

CPU_SBATCH = ["--ntasks-per-node=1", "--gpus-per-node=1", "--cpus-per-task=1", "--time=15"]
"""CPU stand-ins for the job scripts' GPU settings: 1 task and 1 (count-only) GPU per node, 1 CPU."""


def _free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def missing_requirements() -> str | None:
    for tool in ("slurmctld", "slurmd", "sbatch", "munged", "mungekey"):
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"{tool} not installed (Debian: slurmctld slurmd slurm-client munge)"
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root"
    return None


class LocalSlurm:
    def __init__(self, root: Path, nodes: int = 2, cpus: int = 1, gpus: int = 1, first_job_id: int | None = None):
        """``nodes`` slurmd on this host, each declaring ``cpus`` CPUs (more than the host has is allowed: slurmd
        reports the configured count, ``SlurmdParameters=config_overrides``) and ``gpus`` count-only GPUs.

        Job ids start at ``first_job_id``, by default a random one below 12,000: slurm/launch.sh derives the
        rendezvous port from the job id (10000 + id % 20000), and clusters that all numbered their jobs from 1
        would give two test sessions on one machine the same port (EADDRINUSE at the rendezvous); below 12,000
        the port also stays under Linux's ephemeral range (32768 and up), where the ranks' own connections are."""
        self.root = root
        self.first_job_id = first_job_id or random.randint(1, 12000)
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus = cpus
        self.gpus = gpus
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(root / "slurm.conf")}

    def _sbin(self, name: str) -> str:
        return shutil.which(name) or f"/usr/sbin/{name}"

    def start(self) -> "LocalSlurm":
        try:
            self._start()
        except Exception:
            self.stop()  # the daemons started so far would outlive the caller, which holds no cluster to stop
            raise
        return self

    def _start(self) -> None:
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        os.chmod(r / "munge", 0o700)
        key = r / "munge" / "munge.key"
        subprocess.run([self._sbin("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        os.chmod(key, 0o600)
        sock = r / "munge" / "munge.sock"
        self.procs.append(subprocess.Popen(
            [self._sbin("munged"), "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
             f"--pid-file={r / 'munge' / 'munged.pid'}", f"--seed-file={r / 'munge' / 'seed'}",
             f"--log-file={r / 'log' / 'munged.log'}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(lambda: sock.exists(), "munged socket")
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        nodes_cfg = "\n".join(
            f"NodeName={n} NodeHostname=localhost NodeAddr=127.0.0.1 Port={p} CPUs={self.cpus} Gres=gpu:{self.gpus} "
            f"State=UNKNOWN"
            for n, p in zip(self.nodes, node_ports))
        (r / "slurm.conf").write_text(f"""ClusterName=convit-scale-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
FirstJobId={self.first_job_id}
SlurmUser=root
SlurmdUser=root
SlurmdParameters=config_overrides
AuthType=auth/munge
AuthInfo=socket={sock},cred_expire=5
CredType=cred/munge
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd'}.%n.pid
SlurmctldLogFile={r / 'log' / 'slurmctld.log'}
SlurmdLogFile={r / 'log'}/slurmd.%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=2,bf_interval=2
SlurmctldTimeout=30
SlurmdTimeout=30
KillWait=5
{nodes_cfg}
PartitionName=test Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        # Count-only GPUs: lets the real scripts' --gpus-per-node be honoured on a CPU machine. slurmd counts a GPU
        # per device file (Count alone registers none), so each is an empty file of its own.
        (r / "gpu").mkdir(exist_ok=True)
        for i in range(self.gpus):
            (r / "gpu" / f"gpu{i}").touch()
        files = str(r / "gpu" / "gpu0") if self.gpus == 1 else f"{r / 'gpu' / 'gpu'}[0-{self.gpus - 1}]"
        (r / "gres.conf").write_text("AutoDetect=off\n"
                                     + "".join(f"NodeName={n} Name=gpu File={files}\n" for n in self.nodes))
        self.procs.append(subprocess.Popen([self._sbin("slurmctld"), "-D", "-i", "-f", str(r / "slurm.conf")],
                                           env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for n in self.nodes:
            (r / "spool" / n).mkdir(exist_ok=True)
            self.procs.append(subprocess.Popen([self._sbin("slurmd"), "-D", "-N", n, "-f", str(r / "slurm.conf")],
                                               env=self.env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self._wait(self._nodes_idle, "nodes idle", timeout=60)

    def _wait(self, cond, what: str, timeout: float = 30) -> None:
        t0 = time.time()
        while not cond():
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Slurm daemon exited while waiting for {what}: {p.args}\n{self.logs()}")
            if time.time() - t0 > timeout:
                raise TimeoutError(f"local Slurm: no {what} after {timeout}s\n{self.logs()}")
            time.sleep(0.3)

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n, "").startswith("idle") for n in self.nodes)

    def logs(self) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*.log")):
            parts.append(f"--- {f.name}\n" + f.read_text()[-2000:])
        return "\n".join(parts)

    def run(self, *cmd: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), env={**self.env, **(env or {})}, capture_output=True, text=True, check=check)

    def sbatch(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> int:
        res = subprocess.run(["sbatch", "--parsable", *args], env={**self.env, **(env or {})}, capture_output=True,
                             text=True, cwd=cwd)
        if res.returncode != 0:
            raise RuntimeError(f"sbatch failed: {res.stderr}")
        return int(res.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        out = self.run("scontrol", "show", "job", str(job_id), "-o", check=False).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def wait_job(self, job_id: int, timeout: float = 600, states=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                                     "NODE_FAIL", "OUT_OF_MEMORY")) -> dict:
        t0 = time.time()
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.time() - t0 > timeout:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout}s\n{self.logs()}")
            time.sleep(1)

    def stop(self) -> None:
        self.run("scancel", "--full", "-u", "root", check=False)
        time.sleep(1)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
