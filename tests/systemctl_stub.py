#!/usr/bin/python3
"""`systemctl` on a test host (tests/hosts.py), where no systemd runs: the runbook's own commands
(`daemon-reload`, `enable --now`, `start`, `stop`, `kill --signal=`, `is-active`, `status`) run
the units the runbook installed, as systemd would start them.

It reads the unit file from /etc/systemd/system and does what these keys say: User, Group,
UMask, StateDirectory (+Mode), WorkingDirectory, Environment, EnvironmentFile, LoadCredential
(the file copied to /run/credentials/UNIT, readable by the service's user only: `%d`),
ExecStart (with `%i` and `%d`), Restart=on-failure, RestartSec, RestartPreventExitStatus,
KillSignal, TimeoutStopSec, LimitNOFILE. The sandboxing keys are systemd's alone: the unit files
are checked by systemd itself (tests/test_systemd.py: `systemd-analyze verify` and `security`).

Each started unit has a supervisor (this file, `--supervise UNIT`): it runs the service,
restarts it as the unit says, and logs its output to /var/log/UNIT.log (`journalctl -u`)."""

import os
import pwd
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

UNIT_DIR = Path("/etc/systemd/system")
RUN = Path("/run/systemctl-stub")
LOGS = Path("/var/log")


def unit_file(unit: str) -> tuple[Path, str]:
    """(the unit's file, its instance) for `tape-rewinder@rw-1` or `tape-rewinder@rw-1.service`."""
    name = unit.removesuffix(".service")
    template, _, instance = name.partition("@")
    return UNIT_DIR / (f"{template}@.service" if instance else f"{name}.service"), instance


def service_keys(path: Path) -> dict[str, list[str]]:
    keys: dict[str, list[str]] = {}
    section = ""
    for line in path.read_text().splitlines():
        line = line.strip()
        if line.startswith("["):
            section = line
        elif section == "[Service]" and "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            keys.setdefault(key, []).append(value)
    return keys


def prepare(unit: str, keys: dict[str, list[str]], instance: str) -> tuple[list[str], dict, pwd.struct_passwd]:
    """The state directory and credentials made as systemd makes them; the command and environment."""
    user = pwd.getpwnam(keys["User"][-1])
    for name in keys.get("StateDirectory", []):
        state = Path("/var/lib") / name
        state.mkdir(parents=True, exist_ok=True)
        os.chown(state, user.pw_uid, user.pw_gid)
        state.chmod(int(keys.get("StateDirectoryMode", ["0755"])[-1], 8))
    creds = Path("/run/credentials") / unit
    shutil.rmtree(creds, ignore_errors=True)
    creds.mkdir(parents=True)
    for spec in keys.get("LoadCredential", []):
        ident, _, source = spec.partition(":")
        shutil.copyfile(source, creds / ident)
        (creds / ident).chmod(0o400)
        os.chown(creds / ident, user.pw_uid, user.pw_gid)
    os.chown(creds, user.pw_uid, user.pw_gid)
    creds.chmod(0o500)
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "CREDENTIALS_DIRECTORY": str(creds), "HOME": "/",
           "LANG": "C.UTF-8"}
    for assignment in keys.get("Environment", []):
        key, _, value = assignment.partition("=")
        env[key] = value
    for spec in keys.get("EnvironmentFile", []):
        path = Path(spec.removeprefix("-"))
        if path.exists() or not spec.startswith("-"):
            env.update(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
    command = keys["ExecStart"][-1].replace("%i", instance).replace("%d", str(creds)).split()
    return command, env, user


def supervise(unit: str) -> int:
    """Run the service until stopped; restart it on failure as its unit says."""
    path, instance = unit_file(unit)
    keys = service_keys(path)
    stopping = False
    child: subprocess.Popen | None = None

    def stop(*_):
        nonlocal stopping
        stopping = True
        if child and child.poll() is None:
            child.send_signal(getattr(signal, keys.get("KillSignal", ["SIGTERM"])[-1]))

    signal.signal(signal.SIGTERM, stop)
    prevent = {int(c) for c in " ".join(keys.get("RestartPreventExitStatus", [])).split()}
    nofile = int(keys.get("LimitNOFILE", ["1024"])[-1])
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]  # (systemd, PID 1, may raise it; the stub may not)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile, hard), hard))  # the service inherits it
    while not stopping:
        command, env, user = prepare(unit, keys, instance)
        with open(LOGS / f"{unit}.log", "ab") as log:
            child = subprocess.Popen(
                command, env=env, cwd=keys.get("WorkingDirectory", ["/"])[-1], stdin=subprocess.DEVNULL,
                stdout=log, stderr=log, user=user.pw_uid, group=user.pw_gid, extra_groups=[],
                umask=int(keys.get("UMask", ["0022"])[-1], 8))
        (RUN / f"{unit}.main").write_text(str(child.pid))
        rc = child.wait()
        (RUN / f"{unit}.result").write_text(str(rc))
        if stopping or rc == 0 or rc in prevent or keys.get("Restart", ["no"])[-1] != "on-failure":
            break
        time.sleep(float(keys.get("RestartSec", ["0.1"])[-1]))
    return 0


def unit_name(arg: str) -> str:
    return arg if arg.endswith(".service") else f"{arg}.service"


def pid_of(unit: str, what: str = "pid") -> int | None:
    """The unit's supervisor (or `main` process) while it runs; None once it exited (a zombie included:
    no init of this host reaps it)."""
    try:
        pid = int((RUN / f"{unit}.{what}").read_text())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ValueError):
        return None
    return pid if state != "Z" else None


def start(unit: str) -> int:
    if pid_of(unit):
        return 0
    if not unit_file(unit)[0].exists():
        print(f"Failed to start {unit}: Unit {unit} not found.", file=sys.stderr)
        return 5
    RUN.mkdir(parents=True, exist_ok=True)
    (RUN / f"{unit}.result").unlink(missing_ok=True)
    with open(LOGS / f"{unit}.log", "ab") as log:  # (the supervisor's own errors too)
        supervisor = subprocess.Popen([sys.executable, __file__, "--supervise", unit], start_new_session=True,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    (RUN / f"{unit}.pid").write_text(str(supervisor.pid))
    return 0


def stop(unit: str) -> int:
    pid = pid_of(unit)
    if pid:
        os.kill(pid, signal.SIGTERM)
        timeout = float(service_keys(unit_file(unit)[0]).get("TimeoutStopSec", ["90"])[-1])
        deadline = time.monotonic() + timeout
        while pid_of(unit) and time.monotonic() < deadline:
            time.sleep(0.05)
        main = pid_of(unit, "main")
        if main:
            os.kill(main, signal.SIGKILL)
    return 0


def status(unit: str) -> int:
    pid, main = pid_of(unit), pid_of(unit, "main")
    result = (RUN / f"{unit}.result")
    state = "active (running)" if pid and main else (
        f"failed (exit {result.read_text()})" if result.exists() else "inactive (dead)")
    print(f"{unit}\n     Active: {state}\n   Main PID: {main or '-'}")
    log = LOGS / f"{unit}.log"
    if log.exists():
        print("".join(log.read_text().splitlines(keepends=True)[-10:]))
    return 0 if pid and main else 3


def main(argv: list[str]) -> int:
    if argv[:1] == ["--supervise"]:
        return supervise(argv[1])
    verb, args = argv[0], [a for a in argv[1:] if not a.startswith("-")]
    units = [unit_name(a) for a in args]
    if verb == "daemon-reload":
        return 0
    if verb == "enable":
        return max([start(u) for u in units] or [0]) if "--now" in argv else 0
    if verb in ("start", "stop", "restart"):
        rcs = ([stop(u) for u in units] if verb != "start" else []) + (
            [start(u) for u in units] if verb != "stop" else [])
        return max(rcs or [0])
    if verb == "kill":
        name = next((a.split("=", 1)[1] for a in argv if a.startswith(("--signal=", "-s="))), "SIGTERM")
        for u in units:
            if pid_of(u, "main"):
                os.kill(pid_of(u, "main"), getattr(signal, name if name.startswith("SIG") else f"SIG{name}"))
        return 0
    if verb == "is-active":
        return 0 if all(pid_of(u) and pid_of(u, "main") for u in units) else 3
    if verb == "status":
        return max(status(u) for u in units)
    print(f"systemctl (test stub): {verb} is not one the runbook uses", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
