"""fleet reaches hosts the way `ssh` does: a [[hosts]] address may be a ~/.ssh/config alias whose
HostName, Port, User, IdentityFile, UserKnownHostsFile, ProxyJump and IdentityAgent apply, and what
fleet.toml sets wins. A real sshd on 127.0.0.1 (tests/sshd_server.py), HOME pointed at a temp home,
real worker processes on a tiny model."""

from __future__ import annotations

import getpass
import json
import os
import shutil
import signal
import subprocess

import pytest

from tests.conftest import wait_for
from tests.fleet.conftest import fleet, fleet_popen, fleet_toml
from tests.fleet.test_ssh_e2e import Output, launches, tiny_job
from tests.sshd_server import free_port

pytestmark = pytest.mark.ssh


@pytest.fixture
def home(tmp_path, monkeypatch, sshd):
    """A temp HOME (fleet and its subprocesses inherit it) whose ~/.ssh holds the sshd's client key
    and known_hosts under names only ~/.ssh/config points at; no SSH agent."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    shutil.copy(sshd.client_key, home / ".ssh" / "id_gpubox")
    os.chmod(home / ".ssh" / "id_gpubox", 0o600)
    shutil.copy(sshd.known_hosts, home / ".ssh" / "known_hosts_gpubox")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("SSH_AUTH_SOCK", raising=False)
    return home


def host_entry(alias: str, port: int, *extra: str, key: bool = True) -> str:
    lines = [f"Host {alias}", "    HostName 127.0.0.1", f"    Port {port}", "    User root",
             "    UserKnownHostsFile ~/.ssh/known_hosts_gpubox", *(f"    {e}" for e in extra)]
    if key:
        lines.append("    IdentityFile ~/.ssh/id_gpubox")
    return "\n".join(lines) + "\n\n"


def write_ssh_config(home, *entries: str, name: str = "config") -> str:
    path = home / ".ssh" / name
    path.write_text("# fleet's test hosts\n" + "".join(entries))
    return str(path)


def alias_toml(tmp_path, sshd, address: str, model=None, data=None, keep: tuple[str, ...] = (),
               **kw) -> str:
    """fleet.toml whose host is `address` with only the `keep` SSH keys set (the rest from the alias)."""
    if model is None:
        kw.setdefault("job", tiny_job(tmp_path))
    path = fleet_toml(tmp_path, model=model, data=data, port=sshd.port, client_key=sshd.client_key,
                      known_hosts=sshd.known_hosts, address=address, **kw)
    drop = tuple(f"{k} = " for k in ("port", "user", "identity_file", "known_hosts") if k not in keep)
    text = "".join(l for l in open(path).readlines() if not l.startswith(drop))
    open(path, "w").write(text)
    return path


def host_status(config: str) -> tuple[int, dict]:
    r = fleet("status", "--json", "-c", config)
    return r.returncode, json.loads(r.stdout)["hosts"][0]


def test_an_alias_behind_a_jump_host_runs_to_done_with_logs_restart_and_down(tmp_path, home, sshd,
                                                                              dense_model):
    """`address = "gpubox"`, reached through its ProxyJump bastion (the same sshd, both only in
    ~/.ssh/config): up, logs, restart, down and up again to DONE, all through the alias."""
    from worker.demo import make_token_dataset
    data = make_token_dataset(str(tmp_path / "data.jsonl"), 4000, vocab_size=500, mean_tokens=40, seed=11)
    write_ssh_config(home, host_entry("bastion", sshd.port),
                     host_entry("gpubox", sshd.port, "ProxyJump bastion"))
    config = alias_toml(tmp_path, sshd, "gpubox", dense_model, data)
    assert "port =" not in open(config).read() and "127.0.0.1" not in open(config).read()
    proc = fleet_popen("up", "--headless", "-c", config)
    out = Output(proc)
    try:
        wait_for(lambda: out.has("shard 0", "-> LOADING"), 120, what="shard 0 live")   # long before DONE
        proc.send_signal(signal.SIGKILL)                  # the workers run on, unsupervised
        proc.wait(10)
    finally:
        if proc.poll() is None:
            proc.kill()
    try:
        logs = fleet("logs", "box:0", "-c", config)
        assert logs.returncode == 0 and "[shard 0]" in logs.stdout, logs.stdout + logs.stderr
        rs = fleet("restart", "0", "-c", config)
        assert rs.returncode == 0, rs.stdout + rs.stderr
        assert [e["by"] for e in launches(tmp_path, 0)] == ["manual", "manual"]
        down = fleet("down", "--yes", "-c", config)
        assert down.returncode == 0, down.stdout + down.stderr
        code, host = host_status(config)
        assert code == 0 and host["reachable"] is True and host["address"] == "gpubox"
        snap = json.loads(fleet("status", "--json", "-c", config).stdout)
        assert snap["shards"][0]["state"] == "STOPPED"
        assert all(s["alive"] is False for s in snap["shards"])
        for s in snap["shards"]:
            if s["state"] != "DONE":
                again = fleet("restart", str(s["id"]), "-c", config)
                assert again.returncode == 0, again.stdout + again.stderr
        up = fleet("up", "--headless", "-c", config)
        assert up.returncode == 0, up.stdout + up.stderr
        snap = json.loads(fleet("status", "--json", "-c", config).stdout)
        assert [s["state"] for s in snap["shards"]] == ["DONE", "DONE"]
        assert snap["totals"]["done"] == 4000
    finally:
        fleet("down", "--yes", "-c", config)


def test_fleet_toml_wins_over_the_alias_and_the_failing_setting_names_its_file(tmp_path, home, sshd):
    """The alias's Port is a closed one: the error names the port and its file:line; with `port`
    in fleet.toml the same alias connects. Two ProxyJump hops (comma-separated) work too."""
    closed = free_port()
    path = write_ssh_config(home, host_entry("gpubox", closed), host_entry("bastion", sshd.port),
                            host_entry("inner", sshd.port), host_entry("deep", sshd.port, "ProxyJump bastion,inner"))
    config = alias_toml(tmp_path, sshd, "gpubox", gpus=(0,))
    code, host = host_status(config)
    assert code == 3 and host["reachable"] is False
    assert host["error"] == (f"box (gpubox = root@127.0.0.1:{closed}): port {closed} from ~/.ssh/config "
                             f"line 4: connection refused (is sshd listening on port {closed}?)"), host["error"]
    assert open(path).read().splitlines()[3] == f"    Port {closed}"        # line 4 is that line

    config = alias_toml(tmp_path, sshd, "gpubox", gpus=(0,), keep=("port",))
    code, host = host_status(config)
    assert code == 0 and host["reachable"] is True, host

    config = alias_toml(tmp_path, sshd, "deep", gpus=(0,))
    code, host = host_status(config)
    assert code == 0 and host["reachable"] is True, host


def test_a_failing_jump_host_is_named(tmp_path, home, sshd):
    closed = free_port()
    path = write_ssh_config(home, host_entry("bastion", closed),
                            host_entry("gpubox", sshd.port, "ProxyJump bastion"))
    assert open(path).read().splitlines()[13] == "    ProxyJump bastion"    # line 14
    code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
    assert code == 3 and host["error"].startswith(
        f"box (gpubox = root@127.0.0.1:{sshd.port}): jump host bastion = root@127.0.0.1:{closed} "
        f"(ProxyJump bastion from ~/.ssh/config line 14): port {closed} from ~/.ssh/config line 4: "
        f"connection refused"), host["error"]
    # The bastion is fine, the target's port behind it is closed: the jump host says so.
    write_ssh_config(home, host_entry("bastion", sshd.port), host_entry("gpubox", closed, "ProxyJump bastion"))
    code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
    assert code == 3 and host["error"].startswith(
        f"box (gpubox = root@127.0.0.1:{closed}): the jump host cannot reach 127.0.0.1:{closed} (port "
        f"{closed} from ~/.ssh/config line 11): "), host["error"]


def test_an_address_that_is_neither_an_alias_nor_a_host_is_named(tmp_path, home, sshd):
    write_ssh_config(home, host_entry("gpubox", sshd.port))
    config = alias_toml(tmp_path, sshd, "gpubox9", gpus=(0,))
    code, host = host_status(config)
    assert code == 3
    assert host["error"].startswith("box (root@gpubox9:22): 'gpubox9' does not resolve: no such "
                                    "host") and "and ~/.ssh/config gives it no HostName" in host["error"], host
    up = fleet("up", "--headless", "-c", config)
    assert up.returncode == 3 and "'gpubox9' does not resolve" in up.stderr and "Traceback" not in up.stderr


def test_ssh_config_key_names_another_file(tmp_path, home, sshd):
    """`ssh_config = "path"` is read instead of ~/.ssh/config (which here has no such alias)."""
    other = write_ssh_config(home, host_entry("gpubox", sshd.port), name="fleet_hosts")
    config = alias_toml(tmp_path, sshd, "gpubox", gpus=(0,), extra_host=f"ssh_config = {json.dumps(other)}")
    code, host = host_status(config)
    assert code == 0 and host["reachable"] is True, host
    missing = alias_toml(tmp_path, sshd, "gpubox", gpus=(0,), extra_host='ssh_config = "~/.ssh/nope"')
    r = fleet("status", "-c", missing)
    assert r.returncode == 2 and r.stderr.strip().endswith(
        "ssh_config: ~/.ssh/nope: no such file (an OpenSSH client config, like ~/.ssh/config)"), r.stderr


def test_a_key_in_the_ssh_agent_needs_no_identity_file(tmp_path, home, sshd):
    """No IdentityFile anywhere: the key is in an ssh-agent, found through IdentityAgent in the
    alias (SSH_AUTH_SOCK unset), as ssh finds it."""
    sock = str(tmp_path / "agent.sock")
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", sock], stdout=subprocess.DEVNULL)
    try:
        # (the socket file is there a moment before the agent listens on it: ssh-add is tried until it takes)
        add = ["ssh-add", "-q", str(home / ".ssh" / "id_gpubox")]
        wait_for(lambda: subprocess.run(add, env={**os.environ, "SSH_AUTH_SOCK": sock}, capture_output=True)
                 .returncode == 0, 30, 0.2, what="the key added to the ssh-agent")
        os.remove(home / ".ssh" / "id_gpubox")
        write_ssh_config(home, host_entry("gpubox", sshd.port, f"IdentityAgent {sock}", key=False))
        code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
        assert code == 0 and host["reachable"] is True, host
        write_ssh_config(home, host_entry("gpubox", sshd.port, key=False))        # no agent: refused
        code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
        assert code == 3 and "authentication failed as user root from ~/.ssh/config line 5 (keys from " \
                              "the SSH agent / ~/.ssh)" in host["error"], host
    finally:
        agent.terminate()
        agent.wait(10)


def test_host_keys_are_checked_against_the_aliases_known_hosts_file(tmp_path, home, sshd):
    """The alias's UserKnownHostsFile is where the key is looked up (and named, with its line),
    and where accept_new records it, under the resolved [host]:port; a jump host's too."""
    (home / ".ssh" / "empty").write_text("")
    path = write_ssh_config(home, host_entry("gpubox", sshd.port).replace("known_hosts_gpubox", "empty"))
    code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
    assert code == 3 and host["error"].startswith(
        f"box (gpubox = root@127.0.0.1:{sshd.port}): host key unknown (not in known_hosts ~/.ssh/empty "
        f"from ~/.ssh/config line 6; it offers ssh-ed25519 "), host["error"]
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> ~/.ssh/empty" in host["error"]
    code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,), extra_host="accept_new = true"))
    assert code == 0 and host["reachable"] is True, host
    assert (home / ".ssh" / "empty").read_text().startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")
    assert open(path).read().splitlines()[5] == "    UserKnownHostsFile ~/.ssh/empty"

    # An alias that keeps no host keys (SkyPilot's): told how to have fleet check them.
    write_ssh_config(home, host_entry("gpubox", sshd.port).replace("~/.ssh/known_hosts_gpubox", "/dev/null"))
    code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
    assert code == 3 and host["error"] == (
        f"box (gpubox = root@127.0.0.1:{sshd.port}): host key unknown: known_hosts /dev/null from "
        f"~/.ssh/config line 6 keeps no keys; set known_hosts = \"~/.ssh/known_hosts\" and accept_new = "
        f"true for this host (its key is recorded on the first connect and checked after)"), host["error"]

    (home / ".ssh" / "empty").write_text("")
    write_ssh_config(home, host_entry("bastion", sshd.port).replace("known_hosts_gpubox", "empty"),
                     host_entry("gpubox", sshd.port, "ProxyJump bastion"))
    code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
    assert code == 3 and (f"jump host bastion = root@127.0.0.1:{sshd.port} (ProxyJump bastion from "
                          f"~/.ssh/config line 14): host key not trusted by known_hosts ~/.ssh/empty from "
                          f"~/.ssh/config line 6") in host["error"], host["error"]
    # The target behind a trusted bastion, its own key new: accept_new records it through the hop.
    (home / ".ssh" / "empty").write_text("")
    write_ssh_config(home, host_entry("bastion", sshd.port),
                     host_entry("gpubox", sshd.port, "ProxyJump bastion").replace("known_hosts_gpubox", "empty"))
    code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,), extra_host="accept_new = true"))
    assert code == 0 and host["reachable"] is True, host
    assert (home / ".ssh" / "empty").read_text().startswith(f"[127.0.0.1]:{sshd.port} ssh-ed25519 ")


def test_a_hostname_from_the_alias_that_does_not_resolve_names_its_line(tmp_path, home, sshd):
    write_ssh_config(home, host_entry("gpubox", sshd.port).replace("127.0.0.1", "gpubox9.invalid"))
    code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
    assert code == 3 and host["error"].startswith(
        f"box (gpubox = root@gpubox9.invalid:{sshd.port}): hostname gpubox9.invalid from ~/.ssh/config "
        f"line 3 does not resolve: "), host["error"]


def test_resolve_follows_include_patterns_and_fleet_toml_wins(tmp_path, monkeypatch):
    """The SkyPilot layout (an Include of generated per-cluster files at the top of ~/.ssh/config),
    `Host *` defaults after it, and fleet.toml's own keys over both; origins name file and line."""
    from fleet.transport import resolve
    home = tmp_path / "home"
    (home / ".sky" / "generated" / "ssh").mkdir(parents=True)
    (home / ".ssh").mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".ssh" / "config").write_text("Include ~/.sky/generated/ssh/*\n\nHost *\n    User nobody\n"
                                          "    Port 2200\n")
    (home / ".sky" / "generated" / "ssh" / "mycluster").write_text(
        "Host mycluster\n  HostName 198.51.100.4\n  User ubuntu\n  IdentityFile ~/.ssh/sky-key\n"
        "  UserKnownHostsFile=/dev/null\n")
    r = resolve("box", "mycluster")
    assert (r.host, r.port, r.user, r.known_hosts, r.identity_files, r.jump) == \
        ("198.51.100.4", 2200, "ubuntu", "/dev/null", ["~/.ssh/sky-key"], None)
    assert r.origin["user"] == "~/.sky/generated/ssh/mycluster line 3"
    assert r.origin["port"] == "~/.ssh/config line 5"
    assert r.where == "mycluster = ubuntu@198.51.100.4:2200"
    r = resolve("box", "mycluster", port=22, user="root", identity_file="/k", known_hosts="/kh")
    assert (r.port, r.user, r.identity_files, r.known_hosts) == (22, "root", ["/k"], "/kh")
    assert not r.from_file("port") and r.said("port", 22) == "port 22"
    r = resolve("box", "other", str(home / ".sky" / "generated" / "ssh" / "mycluster"))   # ssh_config
    assert (r.host, r.port, r.user, r.config_name()) == ("other", 22, getpass.getuser(),
                                                          "~/.sky/generated/ssh/mycluster")


@pytest.mark.parametrize("hang_up_with", ["close", "reset"])
def test_a_port_that_closes_before_ssh_speaks_is_said_as_such(tmp_path, home, sshd, hang_up_with):
    """Issue 55: a host whose port accepts and closes (a proxy, a firewall, not sshd) read only
    "SSH error: Connection lost". A close that beats the client's first bytes reads as a reset
    (CI saw "Connection reset by peer"): "reset" makes that case every time (SO_LINGER 0 sends RST)."""
    import socket
    import struct
    import threading
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    port = server.getsockname()[1]

    def hang_up() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            if hang_up_with == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()
    threading.Thread(target=hang_up, daemon=True).start()
    try:
        write_ssh_config(home, host_entry("gpubox", port))
        code, host = host_status(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
        assert code == 3 and host["reachable"] is False
        assert f"127.0.0.1:{port} closed the connection before SSH began (not sshd on that port" in host["error"], \
            host["error"]
    finally:
        server.close()


@pytest.mark.parametrize("ciphers_line, expected", [(None, "aes128-gcm@openssh.com"),
                                                    ("Ciphers chacha20-poly1305@openssh.com",
                                                     "chacha20-poly1305@openssh.com")])
async def test_aes_gcm_is_asked_first_unless_the_ssh_config_chooses(tmp_path, home, sshd, ciphers_line, expected):
    """The supervisor decrypts every telemetry line of every host: AES-GCM costs asyncssh a sixth of
    chacha20-poly1305 (its default first) a packet. A `Ciphers` line in the user's config wins."""
    import asyncio
    from fleet.config import load_config
    from fleet.transport import SSHTransport
    write_ssh_config(home, host_entry("gpubox", sshd.port, *([ciphers_line] if ciphers_line else [])))
    config = load_config(alias_toml(tmp_path, sshd, "gpubox", gpus=(0,)))
    transport = SSHTransport(config.hosts[0], config.spec.supervise, asyncio.Semaphore(1))
    await transport.connect()
    try:
        assert (transport.conn.get_extra_info("send_cipher"), transport.conn.get_extra_info("recv_cipher")) == \
            (expected, expected)
    finally:
        await transport.close()
