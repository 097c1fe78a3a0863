"""Enforced egress (the chart's ``egress.enforce``): deploy/egress-gateway-enforce, the
init container's script, run for real.

The test builds a pod's network namespace and a second namespace standing in for the
internet, joined by a veth pair, runs the script in the first and connects from
processes of several UIDs: the agent's (refused), root's in another container (refused),
the sidecar's (allowed); loopback, DNS to the resolver and the allowed CIDRs still work
for everyone; answers to connections into the pod still leave. IPv4 and IPv6 both.

The addresses are 198.18.0.0/15 (RFC 2544, benchmarking) and 2001:db8::/32 (RFC 3849,
documentation): nobody's, and they exist only on the veth pair between the two
namespaces the test creates, which have no other link. Needs root, iproute2 and nftables
(``.ci/run`` installs them): skipped with the reason otherwise, a failure with
``REQUIRE_NETFILTER=1`` (CI).
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "deploy" / "egress-gateway-enforce"
#: The sidecar's UID, as the chart sets it (the image's user).
CHART_VALUES = yaml.safe_load((ROOT / "helm" / "egress-gateway" / "values.yaml").read_text())
SIDECAR_UID = int(CHART_VALUES["sidecar"]["uid"])
AGENT_UID = SIDECAR_UID + 1

POD_V4, POD_V6 = "198.18.0.1", "2001:db8:18::1"
NET_V4, NET_V6 = "198.18.0.2", "2001:db8:18::2"  # "the internet"
INTERNAL_V4, INTERNAL_V6 = "198.18.0.3", "2001:db8:18::3"  # an internal service
RESOLVER_V4, RESOLVER_V6 = "198.18.0.53", "2001:db8:18::53"  # the cluster resolver
SIDECAR_PORT = 18181  # on the pod's loopback
AGENT_SERVER_PORT = 9000  # a server of the agent's, reached from outside the pod

#: Bounds: every socket operation of a probe, each helper process, a server's life.
PROBE_TIMEOUT_S = 2.0
COMMAND_TIMEOUT_S = 30.0
SERVER_LIFETIME_S = 60.0

_counter = itertools.count()

# Listeners: [{proto, addr, port, tag}], after dropping to "uid" when given. Prints
# "ready" once every socket listens; exits when stdin closes or after its lifetime.
SERVER = """
import json, os, socket, sys, threading
spec = json.loads(sys.argv[1])
if spec.get("uid") is not None:
    os.setgroups([]); os.setgid(spec["uid"]); os.setuid(spec["uid"])
def family(addr):
    return socket.AF_INET6 if ":" in addr else socket.AF_INET
def tcp(sock, tag):
    while True:
        conn, _ = sock.accept()
        conn.sendall(tag.encode()); conn.close()
def udp(sock, tag):
    while True:
        _, peer = sock.recvfrom(512)
        sock.sendto(tag.encode(), peer)
for item in spec["listen"]:
    kind = socket.SOCK_STREAM if item["proto"] == "tcp" else socket.SOCK_DGRAM
    sock = socket.socket(family(item["addr"]), kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if ":" in item["addr"]:
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    sock.bind((item["addr"], item["port"]))
    if kind == socket.SOCK_STREAM:
        sock.listen(16)
    serve = tcp if kind == socket.SOCK_STREAM else udp
    threading.Thread(target=serve, args=(sock, item["tag"]), daemon=True).start()
threading.Timer(spec["lifetime_s"], os._exit, (0,)).start()
print("ready", flush=True)
sys.stdin.read()
os._exit(0)
"""

# Connects as "uid" (dropped inside, after the interpreter started as root: its files
# need not be readable by that UID) and prints one result per check: "ok:<tag>" or
# "error:<errno name>" / "error:timeout".
PROBE = """
import errno, json, os, socket, sys
import encodings.idna  # imported while still root: the UID below may not read it
spec = json.loads(sys.argv[1])
if spec.get("uid") is not None:
    os.setgroups([]); os.setgid(spec["uid"]); os.setuid(spec["uid"])
results = []
for proto, addr, port in spec["checks"]:
    fam = socket.AF_INET6 if ":" in addr else socket.AF_INET
    kind = socket.SOCK_STREAM if proto == "tcp" else socket.SOCK_DGRAM
    sock = socket.socket(fam, kind)
    sock.settimeout(spec["timeout_s"])
    try:
        if proto == "tcp":
            sock.connect((addr, port))
        else:
            sock.sendto(b"query", (addr, port))
        results.append("ok:" + sock.recv(512).decode())
    except TimeoutError:
        results.append("error:timeout")
    except OSError as exc:
        results.append("error:" + errno.errorcode.get(exc.errno or 0, str(exc)))
    finally:
        sock.close()
print(json.dumps(results))
"""


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S, check=check
    )


@functools.cache
def netfilter_problem() -> str | None:
    """Why this machine cannot run the namespace tests, or None."""
    if sys.platform != "linux":
        return "network namespaces and nftables are Linux only"
    if os.geteuid() != 0:
        return "creating network namespaces and loading nftables rules needs root"
    for tool, package in (("ip", "iproute2"), ("nft", "nftables")):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install -y {package})"
    probe = f"egtprobe{os.getpid()}"
    made = run("ip", "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    try:
        loaded = subprocess.run(
            ["ip", "netns", "exec", probe, "nft", "-f", "-"],
            input="table inet egress_probe {\n  chain output {\n"
            "    type filter hook output priority filter; policy accept;\n  }\n}\n",
            capture_output=True,
            text=True,
            timeout=COMMAND_TIMEOUT_S,
            check=False,
        )
        if loaded.returncode != 0:
            return f"the kernel refuses nftables rules (no netfilter?): {loaded.stderr.strip()}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


@pytest.fixture
def netfilter() -> None:
    problem = netfilter_problem()
    if problem is None:
        return
    if os.environ.get("REQUIRE_NETFILTER") == "1":
        pytest.fail(f"{problem} (REQUIRE_NETFILTER=1)")
    pytest.skip(f"{problem}; set REQUIRE_NETFILTER=1 to make this a failure")


@dataclass
class Namespaces:
    """The pod's network namespace and "the internet", joined by a veth pair."""

    pod: str
    net: str
    processes: list[subprocess.Popen[str]] = field(default_factory=list)

    def serve(self, ns: str, listen: list[dict[str, Any]], uid: int | None = None) -> None:
        spec = {"listen": listen, "uid": uid, "lifetime_s": SERVER_LIFETIME_S}
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, sys.executable, "-I", "-c", SERVER, json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.processes.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # bounded: the server exits after its lifetime
        assert line == "ready\n", proc.stderr.read() if proc.stderr else line

    def probe(self, ns: str, uid: int | None, checks: list[tuple[str, str, int]]) -> list[str]:
        spec = {"uid": uid, "checks": checks, "timeout_s": PROBE_TIMEOUT_S}
        done = run("ip", "netns", "exec", ns, sys.executable, "-I", "-c", PROBE, json.dumps(spec))
        results: list[str] = json.loads(done.stdout)
        return results

    def enforce(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run("ip", "netns", "exec", self.pod, "sh", str(SCRIPT), *args, check=check)

    def tables(self) -> str:
        return run("ip", "netns", "exec", self.pod, "nft", "list", "tables").stdout


@pytest.fixture
def namespaces(netfilter: None) -> Iterator[Namespaces]:
    suffix = f"{os.getpid()}x{next(_counter)}"
    spaces = Namespaces(pod=f"egtpod{suffix}", net=f"egtnet{suffix}")
    try:
        for ns in (spaces.pod, spaces.net):
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
        # Created inside the pod's namespace, its peer moved straight into the other:
        # nothing ever appears in the machine's own namespace.
        run("ip", "-n", spaces.pod, "link", "add", "eth0", "type", "veth",
            "peer", "name", "eth0", "netns", spaces.net)  # fmt: skip
        addresses = {
            spaces.pod: (POD_V4, POD_V6),
            spaces.net: (NET_V4, INTERNAL_V4, RESOLVER_V4, NET_V6, INTERNAL_V6, RESOLVER_V6),
        }
        for ns, addrs in addresses.items():
            for addr in addrs:
                if ":" in addr:  # nodad: usable at once, not after duplicate detection
                    run("ip", "-n", ns, "-6", "addr", "add", f"{addr}/64", "dev", "eth0", "nodad")
                else:
                    run("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            run("ip", "-n", ns, "link", "set", "eth0", "up")
        yield spaces
    finally:
        for proc in spaces.processes:
            if proc.stdin is not None:
                proc.stdin.close()
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()
        for ns in (spaces.pod, spaces.net):
            run("ip", "netns", "del", ns, check=False)


def tcp(addr: str, port: int, tag: str) -> dict[str, Any]:
    return {"proto": "tcp", "addr": addr, "port": port, "tag": tag}


def udp(addr: str, port: int, tag: str) -> dict[str, Any]:
    return {"proto": "udp", "addr": addr, "port": port, "tag": tag}


def start_world(spaces: Namespaces) -> None:
    spaces.serve(
        spaces.net,
        [
            *(tcp(a, 8080, "internet") for a in (NET_V4, NET_V6)),
            *(tcp(a, p, "internal") for a in (INTERNAL_V4, INTERNAL_V6) for p in (8080, 8443)),
            *(udp(a, 53, "dns") for a in (RESOLVER_V4, RESOLVER_V6)),
            *(tcp(a, 53, "dns") for a in (RESOLVER_V4, RESOLVER_V6)),
            *(udp(a, 5353, "not-dns") for a in (RESOLVER_V4, RESOLVER_V6)),
        ],
    )
    # The sidecar on the pod's loopback, and a server of the agent's own on the pod IP.
    spaces.serve(
        spaces.pod,
        [tcp("127.0.0.1", SIDECAR_PORT, "sidecar"), tcp("::1", SIDECAR_PORT, "sidecar")],
        uid=SIDECAR_UID,
    )
    spaces.serve(
        spaces.pod,
        [tcp(POD_V4, AGENT_SERVER_PORT, "agent"), tcp(POD_V6, AGENT_SERVER_PORT, "agent")],
        uid=AGENT_UID,
    )


#: (check, what the agent's UID gets once the rules are in force).
AGENT_EXPECTED: list[tuple[tuple[str, str, int], str]] = [
    (("tcp", NET_V4, 8080), "error:ECONNREFUSED"),
    (("tcp", NET_V6, 8080), "error:ECONNREFUSED"),
    (("udp", RESOLVER_V4, 5353), "error:EPERM"),  # the resolver's host, not its port
    (("udp", RESOLVER_V6, 5353), "error:EPERM"),
    (("tcp", INTERNAL_V4, 8080), "error:ECONNREFUSED"),  # allowed on 8443 only
    (("tcp", "127.0.0.1", SIDECAR_PORT), "ok:sidecar"),
    (("tcp", "::1", SIDECAR_PORT), "ok:sidecar"),
    (("udp", RESOLVER_V4, 53), "ok:dns"),
    (("tcp", RESOLVER_V4, 53), "ok:dns"),
    (("udp", RESOLVER_V6, 53), "ok:dns"),
    (("tcp", RESOLVER_V6, 53), "ok:dns"),
    (("tcp", INTERNAL_V4, 8443), "ok:internal"),
    (("tcp", INTERNAL_V6, 8080), "ok:internal"),  # a whole CIDR allowed: any port
]
ENFORCE_ARGS = (
    "--uid", str(SIDECAR_UID),
    "--allow", f"{INTERNAL_V4}/32 tcp 8443",
    "--allow", f"{INTERNAL_V6}/128",
)  # fmt: skip


def test_only_the_sidecar_uid_reaches_the_network(namespaces: Namespaces, tmp_path: Path) -> None:
    start_world(namespaces)
    checks = [check for check, _ in AGENT_EXPECTED]
    # Before the rules, every destination answers the agent: the refusals below are the
    # rules' doing, not a missing route.
    before = namespaces.probe(namespaces.pod, AGENT_UID, checks)
    assert [r.split(":")[0] for r in before] == ["ok"] * len(checks), before

    # The resolvers come from the pod's resolv.conf, as in a pod (dnsPolicy ClusterFirst).
    resolv = tmp_path / "resolv.conf"
    resolv.write_text(
        f"search agents.svc.cluster.local svc.cluster.local\nnameserver {RESOLVER_V4}\n"
        f"nameserver {RESOLVER_V6}\noptions ndots:5\n"
    )
    done = namespaces.enforce(*ENFORCE_ARGS, "--resolv-conf", str(resolv))
    assert "table inet egress_gateway" in done.stdout  # the rules, in the init container's log
    assert f"DNS to {RESOLVER_V4}, DNS to {RESOLVER_V6}" in done.stdout

    agent = namespaces.probe(namespaces.pod, AGENT_UID, checks)
    assert dict(zip(checks, agent, strict=True)) == dict(AGENT_EXPECTED)

    # Root in another container of the pod is refused as well: only the UID counts.
    internet = [("tcp", NET_V4, 8080), ("tcp", NET_V6, 8080), ("udp", RESOLVER_V4, 5353)]
    assert namespaces.probe(namespaces.pod, 0, internet) == [
        "error:ECONNREFUSED",
        "error:ECONNREFUSED",
        "error:EPERM",
    ]
    # The sidecar reaches everything (its own policy and egress rules decide).
    sidecar = namespaces.probe(namespaces.pod, SIDECAR_UID, [*internet, ("tcp", INTERNAL_V4, 8080)])
    assert sidecar == ["ok:internet", "ok:internet", "ok:not-dns", "ok:internal"]

    # Connections into the pod (kubelet probes, scrapes, an agent's own server) are
    # answered: replies are established traffic, whatever the UID of their socket.
    inbound = [("tcp", POD_V4, AGENT_SERVER_PORT), ("tcp", POD_V6, AGENT_SERVER_PORT)]
    assert namespaces.probe(namespaces.net, None, inbound) == ["ok:agent", "ok:agent"]


def test_a_rerun_replaces_the_table_and_a_refused_load_changes_nothing(
    namespaces: Namespaces,
) -> None:
    # A refused ruleset (nft checks the address) loads nothing at all: no half firewall.
    refused = namespaces.enforce("--uid", str(SIDECAR_UID), "--allow", "300.1.2.3", check=False)
    assert refused.returncode == 1
    assert "nothing was changed" in refused.stderr
    assert "egress_gateway" not in namespaces.tables()

    args = ("--uid", str(SIDECAR_UID), "--dns", RESOLVER_V4)
    first = namespaces.enforce(*args).stdout
    namespaces.enforce(*args)  # an init container that is retried
    assert namespaces.tables().count("table inet egress_gateway") == 1
    listed = run("ip", "netns", "exec", namespaces.pod, "nft", "list", "table", "inet",
                 "egress_gateway").stdout  # fmt: skip
    assert listed.count("meta skuid") == 1
    assert listed.count("meta skuid") == first.count("meta skuid")

    # A refused reload keeps the rules in force.
    again = namespaces.enforce(*args, "--allow", "2001:db8::/129", check=False)
    assert again.returncode == 1
    assert namespaces.tables().count("table inet egress_gateway") == 1
    start_world(namespaces)
    assert namespaces.probe(namespaces.pod, AGENT_UID, [("tcp", NET_V4, 8080)]) == [
        "error:ECONNREFUSED"
    ]


# --- the ruleset the script writes, without loading it (no root needed) ----------------


def dry_run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run("sh", str(SCRIPT), "--dry-run", *args, check=check)


def test_dry_run_prints_one_inet_table_for_both_families(tmp_path: Path) -> None:
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 10.96.0.10\nnameserver fe80::53%eth0\nsearch svc\n")
    out = dry_run(
        "--uid", "10001",
        "--resolv-conf", str(resolv),
        "--allow", "10.20.0.0/16 tcp 8080,8443,9000-9010",
        "--allow", "fd00:20::/64 udp 5000",
        "--allow", "192.0.2.7",
    ).stdout  # fmt: skip
    lines = [line.strip() for line in out.splitlines()]
    # Idempotent: the table is created if missing, then deleted and written whole.
    assert lines[:3] == [
        "table inet egress_gateway",
        "delete table inet egress_gateway",
        "table inet egress_gateway {",
    ]
    assert "type filter hook output priority filter; policy drop;" in lines
    rules = [line.split(" comment ")[0] for line in lines[5:-2]]
    assert rules == [
        'oifname "lo" accept',
        "meta skuid 10001 accept",
        "ct state established,related accept",
        "icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert, nd-router-solicit } "
        "ip6 hoplimit 255 accept",
        "ip daddr { 10.96.0.10 } meta l4proto { tcp, udp } th dport 53 accept",
        "ip6 daddr { fe80::53 } meta l4proto { tcp, udp } th dport 53 accept",
        "ip daddr 10.20.0.0/16 tcp dport { 8080, 8443, 9000-9010 } accept",
        "ip6 daddr fd00:20::/64 udp dport { 5000 } accept",
        "ip daddr 192.0.2.7 accept",
        "meta l4proto tcp counter reject with tcp reset",
        "counter drop",
    ]


def test_dns_flags_replace_resolv_conf(tmp_path: Path) -> None:
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("nameserver 10.96.0.10\n")
    args = ("--uid", "10001", "--resolv-conf", str(resolv), "--dns", "169.254.20.10")
    out = dry_run(*args, "--dns-port", "5353").stdout
    assert "ip daddr { 169.254.20.10 } meta l4proto { tcp, udp } th dport 5353 accept" in out
    assert "10.96.0.10" not in out

    empty = dry_run("--uid", "10001", "--resolv-conf", str(tmp_path / "missing"))
    assert "no resolver found" in empty.stderr
    assert "th dport" not in empty.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((), "--uid UID is required"),
        (("--uid", "gateway"), "--uid UID is required"),
        (("--uid", "10001", "--allow", "10.0.0.0/8; flush ruleset"), "not an IP address"),
        (("--uid", "10001", "--allow", "10.0.0.0/8 icmp 1"), "protocol must be tcp or udp"),
        (("--uid", "10001", "--allow", "10.0.0.0/8 tcp 70000"), "not a port (1-65535): '70000'"),
        (("--uid", "10001", "--allow", "10.0.0.0/8 tcp"), "'CIDR' or 'CIDR tcp|udp PORTS'"),
        (("--uid", "10001", "--allow", "10.0.0.0/8 tcp 80,}"), "not a port"),
        (("--uid", "10001", "--dns", "resolver.local"), "not an IP address"),
        (("--uid", "10001", "--dns-port", "0"), "not a port"),
        (("--uid", "10001", "--table", "x y"), "not a table name"),
        (("--uid", "10001", "--frobnicate"), "unknown argument '--frobnicate'"),
    ],
)
def test_usage_errors_exit_2_naming_the_value(args: tuple[str, ...], message: str) -> None:
    done = dry_run(*args, check=False)
    assert done.returncode == 2
    assert message in done.stderr
    assert done.stdout == ""


def test_help_is_the_header_comment() -> None:
    out = run("sh", str(SCRIPT), "--help").stdout
    assert out.startswith("egress-gateway-enforce: make the pod's network namespace")
    assert "--allow SPEC" in out
    assert "set -euf" not in out
