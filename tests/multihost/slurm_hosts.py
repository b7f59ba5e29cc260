"""A Slurm cluster on namespace hosts: slurmctld on h0, one slurmd per host, jobs submitted from h0.

Debian's slurm-wlm (22.05) as .ci/slurm_setup.sh installs it, with that script's settings (no cgroups:
proctrack/linuxproc, task/none) but a configuration file, state, spool, logs and pid files of its own
under ``root``, so it runs beside the one-node cluster of tests/integration/test_slurm.py. Authentication
goes through the machine's munged (a Unix socket, reachable from every namespace); `.ci/slurm_setup.sh
--munge` starts it. Each host runs one slurmd with 1 CPU, so a two-task array job lands on both hosts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

from netns_hosts import Host

ACTIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED"}


def slurm_problem() -> str | None:
    """None when Slurm's daemons and clients are installed and munge answers, else why not."""
    for tool in ("slurmctld", "slurmd", "sbatch", "scontrol", "sinfo", "munge", "unmunge"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return f"{tool} not installed (CI installs Slurm and munge with .ci/slurm_setup.sh)"
    probe = subprocess.run("munge -n | unmunge", shell=True, capture_output=True, text=True, timeout=20)
    if probe.returncode != 0:
        return f"munge does not answer ({probe.stderr.strip()[:200]}); start it with .ci/slurm_setup.sh --munge"
    return None


class SlurmCluster:
    """``start()`` the daemons; ``env()`` for clients and jobs; everything ends with the hosts' teardown."""

    def __init__(self, hosts: list[Host], root: Path) -> None:
        self.hosts, self.root = hosts, root
        self.conf = root / "slurm.conf"
        self.daemons: list[subprocess.Popen] = []

    def _write_conf(self) -> None:
        for d in ("state", "spool", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        mem_mb = 1024
        nodes = "\n".join(f"NodeName={h.name} NodeAddr={h.addr} CPUs=1 RealMemory={mem_mb}" for h in self.hosts)
        names = ",".join(h.name for h in self.hosts)
        self.conf.write_text(
            f"""# a {len(self.hosts)}-host cluster on network namespaces (tests/multihost/slurm_hosts.py)
ClusterName=miles-netns
SlurmctldHost={self.hosts[0].name}({self.hosts[0].addr})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool/%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/log/slurmctld.log
SlurmdLogFile={self.root}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SlurmdParameters=config_overrides
KillWait=10
InactiveLimit=0
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
{nodes}
PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP
"""
        )

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        return {**os.environ, **(base or {}), "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> None:
        self._write_conf()
        (self.root / "spool").mkdir(exist_ok=True)
        for h in self.hosts:
            (self.root / "spool" / h.name).mkdir(exist_ok=True)
        log = open(self.root / "log" / "daemons.out", "ab")  # noqa: SIM115 - the daemons hold it
        h0 = self.hosts[0]
        self.daemons.append(
            h0.popen(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)], stdout=log, stderr=log)
        )
        for h in self.hosts:
            self.daemons.append(
                h.popen(["/usr/sbin/slurmd", "-D", "-f", str(self.conf), "-N", h.name], stdout=log, stderr=log)
            )
        deadline = time.monotonic() + timeout_s
        while (states := self.node_states()) != {h.name: "idle" for h in self.hosts}:
            ended = [d.args[-1] for d in self.daemons if d.poll() is not None]
            if ended or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the namespace Slurm cluster did not come up (states {states}, ended {ended})\n{self.logs()}"
                )
            time.sleep(0.5)

    def client(self, argv: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command run on h0 against this cluster."""
        return self.hosts[0].run(argv, env=self.env(env), **kwargs)

    def node_states(self) -> dict[str, str]:
        out = self.client(["sinfo", "-h", "-N", "-o", "%N %t"], env={}, timeout=20)
        pairs = [line.split() for line in out.stdout.splitlines() if len(line.split()) == 2]
        return {name: state.rstrip("*~#") for name, state in pairs}

    def logs(self) -> str:
        return "\n".join(
            f"== {p}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((self.root / "log").glob("*"))
        )

    def submit(self, argv: list[str], env: dict[str, str], cwd: Path) -> str:
        out = self.client(argv, env=env, cwd=cwd, timeout=120)
        assert out.returncode == 0, f"{' '.join(argv)} failed: {out.stdout}{out.stderr}"
        job_id = out.stdout.strip().splitlines()[-1].split(";")[0]
        assert job_id.isdigit(), out.stdout
        return job_id

    def records(self, job_id: str) -> list[dict[str, str]]:
        """One dict per job (or array task) from `scontrol -o show job`."""
        out = self.client(["scontrol", "-o", "show", "job", job_id], env={}, timeout=30)
        records = []
        for line in out.stdout.splitlines():
            fields = dict(tok.split("=", 1) for tok in line.split() if "=" in tok)
            if fields:
                records.append(fields)
        return records

    def wait_done(self, job_ids: list[str], timeout_s: float, on_poll=None) -> dict[str, list[dict[str, str]]]:
        deadline = time.monotonic() + timeout_s
        while True:
            records = {j: self.records(j) for j in job_ids}
            states = [r["JobState"] for rs in records.values() for r in rs]
            if states and not ACTIVE_STATES & set(states):
                return records
            if on_poll is not None:
                on_poll(records)
            if time.monotonic() > deadline:
                self.client(["scancel", *job_ids], env={})
                raise AssertionError(f"Slurm jobs {job_ids} not done after {timeout_s:.0f} s: states {states}")
            time.sleep(1.0)
