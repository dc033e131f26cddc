"""A shaped network of local hosts: one network namespace per host on a Linux bridge, each host
running one or several ranks.

    root namespace                      namespace hc-wire-<h> (host h, "hc-ns<h>": its ranks)
    bridge hcw-br 10.77.0.1/24 --- hcw-h<h> ====veth==== hcw-eth 10.77.0.(10+h)/24
          (the launcher and its          tbf <rate>       tbf <rate>
           rendezvous server)

A layout says how many ranks each host runs (`parse_layout`: "4x1" is four hosts of one rank, "2x2"
two hosts of two, "3+2" a host of three and one of two). The ranks of one host share its namespace,
so they reach each other over its loopback (unshaped, not counted on the veth) and the other hosts
through its one veth: they share its rate, as the GPUs of a server share its network card. Ranks
are numbered host by host, as Horovod's launcher assigns them (`host_of`), so Horovod's
local_rank, local_size, cross_rank and cross_size are those of the real layout.

Every host's link is shaped in both directions (the egress of both veth ends)
with a token bucket: `tc qdisc add dev <veth> root tbf rate <rate> burst <B>
latency 50ms`, so each host uploads and downloads at <rate> at most, like a
host on a switch port. B = max(4 ms of traffic at the rate, 64 KiB): the bucket
must hold the largest packet (the veths keep MTU 1500 and their segmentation
offloads, so TCP hands over up to 64 KiB at once), and a few milliseconds of
slack let tbf keep its rate through timer and scheduling delays (one TCP
stream measured here: 95.8 Mbit/s at 100mbit, 956 at 1gbit, i.e. the
1448/1514 that headers leave, and 9.4 Gbit/s at 10gbit, near this VM's
unshaped 10.6). Bursting changes a step's time by at most B / rate (4 to 5 ms).
tbf charges each offloaded super-packet for the headers of all its 1500-byte
frames, so the shaping is that of a real MTU-1500 link; the veth byte counters
count one set of headers per super-packet.

TCP is the kernel's default (cubic), except that slow_start_after_idle=False
sets net.ipv4.tcp_slow_start_after_idle=0 in the namespaces, a common tuning
on clusters: by default a connection idle for longer than its retransmission
timeout (200 ms at least) starts again from a congestion window of 10
segments, and the compute between two steps' exchanges is such a pause.
Every namespace sets net.ipv4.tcp_no_metrics_save=1, so each job starts from a
clean TCP state, not from what the previous job's connections left cached.

Each namespace gets /etc/netns/<ns>/hosts (bind-mounted over /etc/hosts by
`ip netns exec`) that resolves every host's name to its address, and
`command()` starts a rank on its host (`enter_host`: in the host's namespace, under
`unshare --uts` with the host's name set): Horovod's Gloo contexts bind the address their
hostname resolves to (the ranks of one host bind the same address, on ports of their own),
and an MPI launch finds its daemons by their hosts' names. `rsh_agent()` writes the
remote shell through which Open MPI's mpirun enters the hosts, where ssh would log into them.

Only root can do this; `check_rights()` says why not, else None. `Network` is
a context manager that removes everything it made (namespaces and the
processes left in them, veths, bridge, /etc/netns/hc-wire-*), also what a
crashed earlier run left behind; it holds a lock file meanwhile, so two runs
take turns instead of tearing down each other's links.
"""
import atexit
import fcntl
import ipaddress
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess

PREFIX = "hc-wire-"  # namespaces; leftovers with this prefix are removed
BRIDGE = "hcw-br"
HOST_VETH = "hcw-h{}"  # bridge-side end of host h's link (root namespace)
IFACE = "hcw-eth"  # namespace-side end, the same name in every namespace
SUBNET = ipaddress.ip_network("10.77.0.0/24")
BRIDGE_ADDRESS = "10.77.0.1"
LOCK = pathlib.Path("/run/hc-wire.lock")
ETC_NETNS = pathlib.Path("/etc/netns")
LATENCY = "50ms"  # tbf queue: at most this much traffic waits, the rest is dropped
#: the TCP payload of a shaped link's rate: tbf charges every 1448-byte segment 66 B of headers (measured above)
TCP_PAYLOAD_FRACTION = 1448 / 1514


def parse_layout(text):
    """Ranks per host from "HxL" (H hosts of L ranks), "a+b+..." (hosts of a, b, ... ranks) or "N"
    (N hosts of one rank each, the layout of one rank per machine)."""
    text = str(text).strip().lower()
    try:
        if "x" in text:
            hosts, ranks = (int(t) for t in text.split("x"))
            counts = [ranks] * hosts
        else:
            counts = [int(t) for t in text.split("+")] if "+" in text else [1] * int(text)
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise ValueError(f"a host layout looks like 2x2 (2 hosts of 2 ranks), 3+2 (hosts of 3 and 2 ranks) "
                         f"or 4 (4 hosts of one rank), got {text!r}.")
    return counts


def layout_name(counts):
    """"2x2" for hosts of equal rank counts, else "3+2"."""
    return f"{len(counts)}x{counts[0]}" if len(set(counts)) == 1 else "+".join(map(str, counts))


def rate_bits(rate):
    """tc's rate syntax ('100mbit', '1gbit', '1.5gbit', '800kbit', '9600bit') in bits per second."""
    match = re.fullmatch(r"([0-9.]+)([kmg]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"rate must look like 100mbit, 1gbit or 10gbit, got {rate!r}.")
    return float(match.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]


def burst_bytes(rate):
    """tbf bucket: 4 ms of traffic at line rate, at least 64 KiB (one offloaded TCP packet)."""
    return max(int(rate_bits(rate) / 8 * 0.004), 64 * 1024)


def _run(*argv):
    return subprocess.run(argv, check=True, capture_output=True, text=True, timeout=60).stdout


def _quiet(*argv):
    subprocess.run(argv, capture_output=True, timeout=60)


def check_rights():
    """None if this process can build the network, else why not (for a message or pytest.skip)."""
    if os.geteuid() != 0:
        return "needs root to create network namespaces, veths and tc qdiscs"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"needs the `{tool}` command (iproute2 / util-linux)"
    probe = f"hc-probe-{os.getpid()}"  # not PREFIX: a concurrent run's cleanup must not take it
    try:
        _run("ip", "netns", "add", probe)
        _run("ip", "-n", probe, "link", "add", "name", "hcp-a", "type", "veth", "peer", "name", "hcp-b")
        _run("tc", "-n", probe, "qdisc", "add", "dev", "hcp-a", "root", "tbf", "rate", "1mbit",
             "burst", "64kb", "latency", LATENCY)
        _run("ip", "netns", "exec", probe, "unshare", "--uts", "--", "true")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        detail = (getattr(e, "stderr", "") or "").strip()
        return f"cannot build a shaped network namespace ({' '.join(e.cmd)}: {detail or e})"
    finally:
        _quiet("ip", "netns", "del", probe)
    return None


def remove_all():
    """Removes every namespace named hc-wire-* (killing what runs in it), the bridge, the veths
    and /etc/netns/hc-wire-*: what this module makes, from this run or a crashed one."""
    names = [line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()]
    for ns in (n for n in names if n.startswith(PREFIX)):
        for pid in _run("ip", "netns", "pids", ns).split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _quiet("ip", "netns", "del", ns)  # also destroys the veth pair whose end is inside
    for line in _run("ip", "-o", "link", "show").splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name == BRIDGE or re.fullmatch(HOST_VETH.format(r"\d+"), name):
            _quiet("ip", "link", "del", name)
    if ETC_NETNS.is_dir():
        for path in ETC_NETNS.glob(f"{PREFIX}*"):
            shutil.rmtree(path, ignore_errors=True)
        if not any(ETC_NETNS.iterdir()):
            ETC_NETNS.rmdir()


class Network:
    """Hosts in namespaces joined by links shaped to `rate`; see the module docstring. `hosts`: a
    layout (parse_layout's text or its list of ranks per host), or a number N of one-rank hosts.

        with Network("2x2", "1gbit") as net:
            subprocess.Popen(net.command(rank, [python, script, ...]), env=...)
    """

    def __init__(self, hosts, rate, slow_start_after_idle=True):
        self.ranks_per_host = parse_layout(hosts) if not isinstance(hosts, list) else list(hosts)
        if not 1 <= len(self.ranks_per_host) <= 200:
            raise ValueError(f"a network has 1..200 hosts, got {len(self.ranks_per_host)}.")
        self.layout = layout_name(self.ranks_per_host)
        self.num_hosts, self.num_ranks = len(self.ranks_per_host), sum(self.ranks_per_host)
        #: the host of each rank, ranks numbered host by host (Horovod's launcher's order)
        self.host_of = [h for h, count in enumerate(self.ranks_per_host) for _ in range(count)]
        self.rate, self.burst = rate, burst_bytes(rate)
        self.slow_start_after_idle = slow_start_after_idle
        self.namespaces = [f"{PREFIX}{h}" for h in range(self.num_hosts)]
        self.hostnames = [f"hc-ns{h}" for h in range(self.num_hosts)]
        self.addresses = [str(SUBNET[10 + h]) for h in range(self.num_hosts)]
        self.server_address, self.iface, self.subnet = BRIDGE_ADDRESS, IFACE, SUBNET
        self._lock = None

    @property
    def slots(self):
        """The layout as horovodrun's -H takes it: "hc-ns0:2,hc-ns1:2"."""
        return ",".join(f"{name}:{count}" for name, count in zip(self.hostnames, self.ranks_per_host))

    def command(self, rank, argv):
        """argv run as rank `rank`: on its host (enter_host)."""
        return self.enter_host(self.host_of[rank], argv)

    def enter_host(self, host, argv):
        """argv run on host `host`: inside its namespace, in a UTS namespace of its own named as the host."""
        return ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "--", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostnames[host], *argv]

    def rsh_agent(self, path):
        """Writes to `path` an executable that Open MPI's mpirun can use as its remote shell (-mca
        plm_rsh_agent): called as ssh would be, `<agent> <host name> <command words>`, it runs the command
        as a shell would (the words joined by spaces, as ssh passes them) on that host (enter_host). Returns
        path."""
        cases = "".join(f'  {shlex.quote(name)}) shift; exec {shlex.join(self.enter_host(h, ["sh", "-c"]))} "$*" ;;\n'
                        for h, name in enumerate(self.hostnames))
        path = pathlib.Path(path)
        path.write_text(f'#!/bin/sh\ncase "$1" in\n{cases}  *) echo "rsh_agent: unknown host $1" >&2; exit 2 ;;\nesac\n')
        path.chmod(0o755)
        return path

    def __enter__(self):
        self._lock = open(LOCK, "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"netns: waiting for another run that holds {LOCK} ...", flush=True)
            fcntl.flock(self._lock, fcntl.LOCK_EX)
        atexit.register(self.close)
        try:
            remove_all()
            self._check_subnet_is_free()
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        """Removes the network (idempotent; also registered with atexit)."""
        if self._lock is None:
            return
        try:
            remove_all()
        finally:
            self._lock.close()  # releases the flock
            self._lock = None
            atexit.unregister(self.close)

    def _check_subnet_is_free(self):
        for line in _run("ip", "-o", "-4", "addr", "show").splitlines():
            fields = line.split()
            address = ipaddress.ip_interface(fields[fields.index("inet") + 1])
            if address.network.overlaps(SUBNET):
                raise RuntimeError(f"{SUBNET} is already used on this machine ({line.strip()}); "
                                   "netns.py only uses its own private subnet and will not share it.")

    def _shape(self, *where):
        """tbf on the egress of one veth end; `where` is ('dev', name) or ('-n', ns, 'dev', name)."""
        _run("tc", *where[:-2], "qdisc", "add", *where[-2:], "root", "tbf", "rate", self.rate,
             "burst", str(self.burst), "latency", LATENCY)

    def _build(self):
        _run("ip", "link", "add", BRIDGE, "type", "bridge")
        _run("ip", "addr", "add", f"{BRIDGE_ADDRESS}/{SUBNET.prefixlen}", "dev", BRIDGE)
        _run("ip", "link", "set", BRIDGE, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{address} {hostname}\n" for address, hostname in zip(self.addresses, self.hostnames))
        for h, (ns, address) in enumerate(zip(self.namespaces, self.addresses)):
            host_veth = HOST_VETH.format(h)
            (ETC_NETNS / ns).mkdir(parents=True, exist_ok=True)
            (ETC_NETNS / ns / "hosts").write_text(hosts)
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", "name", host_veth, "mtu", "1500", "type", "veth",
                 "peer", "name", IFACE, "mtu", "1500", "netns", ns)
            _run("ip", "link", "set", host_veth, "master", BRIDGE, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/{SUBNET.prefixlen}", "dev", IFACE)
            _run("ip", "-n", ns, "link", "set", IFACE, "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            # Each job starts from a clean TCP state: no ssthresh or RTT cached from the previous
            # job's connections to the same address (a bulk fp32 run would slow the next method).
            _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_no_metrics_save=1")
            if not self.slow_start_after_idle:  # keep cwnd across the compute gaps between steps
                _run("ip", "netns", "exec", ns, "sysctl", "-qw", "net.ipv4.tcp_slow_start_after_idle=0")
            self._shape("dev", host_veth)  # bridge -> host h (its download)
            self._shape("-n", ns, "dev", IFACE)  # host h -> bridge (its upload)
