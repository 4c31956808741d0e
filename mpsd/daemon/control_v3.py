# MPS v3's module-verb commands (NVIDIA's MPS documentation, releases 615 and 620, "MPS v3 Interface"), for a
# daemon started with protocol 3, over the state the legacy (v2) language already keeps: `server list`,
# `server create --uid=UID`, `server delete`, `server set` / `server get` of the active thread percentage, the
# pinned memory limit and the client priority (the names the v3 configuration file gives them), `client list
# [--all]`, `client terminate`, and `namespace list|create|delete|set|get` (mpsd.daemon.namespaces; a command
# that came by a routed control socket, $PIPE/<server>[/<namespace>]/control, is about that server and
# namespace unless it names others). The legacy commands still work on such a daemon, as NVIDIA says they do.
#
# The documentation names the modules and a few commands (`server list`, `server create --uid=UID`, `client
# list --all`, `namespace create|delete|list|set|get`); it gives no output format, no usage or error text and
# no option names beyond --uid and --all. Everything else here is mpsd's guess, listed so that a recording of
# the real tool can replace it (README's control-plane section lists the same):
#   - options are written --name=value or --name value; the server is named by --pid=PID (its pid, as v2);
#     no --pid in set/get means the defaults the next server starts with (v2's set_default_* and get_default_*)
#   - option names: --active-thread-percentage, --pinned-memory-limit, --client-priority, --device, --force
#   - `server set` and `server create` print nothing; `server get` prints the value as v2's get commands do
#     (50.0, 2G, 0), `--pinned-memory-limit` without --device one DEV=LIMIT line per device that has one
#   - `server list`'s and `client list`'s columns (NAME PID UID STATUS; PID SERVER UID STATUS DEVICE), their
#     header only when there is a row (as v2's ps), a server without a name shown as "-", a named server of
#     the -a file that does not run now as PID "-" and status INACTIVE
#   - `client list` shows the clients of the running server (another user's only to root or the daemon's
#     owner, as v2's ps); --all adds the clients waiting for their user's server, as PENDING
#   - every text of a failure: "Usage: ..." lines, 'Unknown command "server x"', 'Unknown option "--x"',
#     'Invalid ... "x"', v2's "Server N not found" and "A user id (UID) is required to start a new server",
#     "Permission denied: ..."; a failure goes to stderr and the tool exits 1 (mpsd_protocol's "!" packet
#     carries that)
#   - values are parsed strictly (mpsd_protocol's parsers), not with v2's C quirks: a v3 command is a
#     scripting interface, and a typo should fail rather than set 0
#   - namespace commands name their server with --server=NAME (the -a file's), --uid=UID or --pid=PID, else
#     the routed socket's, else the running server's ("No server given and none is running: ..."), and the
#     namespace with --name=NAME; `namespace list`'s columns SERVER UID NAMESPACE CLIENTS (CLIENTS: processes),
#     `default` first; `namespace get` prints what a client that comes now gets there (inside its server's),
#     a limit as server get's DEV=LIMIT lines, --cgroup the path or nothing; set and create print nothing;
#     'Namespace "x" already exists', 'Namespace "x" not found', 'Namespace "x" has N client(s)' (delete is
#     refused while it has clients), 'The "default" namespace is its server: use server set', 'The "default"
#     namespace goes only with its server', 'Invalid cgroup "x", ...'; a namespace's sockets come with create
#     (for a named server only) and go with delete; `client list`'s NAMESPACE column (a process's first
#     context's); control.log's "Namespace X created for server Y" and "... deleted"
#   - `client list` asked on a routed control socket lists the clients of that server's namespace only (by
#     the contexts in it; a process with contexts in several shows there with that namespace), and with --all
#     the clients of that server's user waiting for it
#   - the partition module's verbs, `partition create|delete|list` (NVIDIA's pages name the module and the
#     -a file's partitions, no verb or option): `partition create --device=DEV --chunks=N [--name=NAME]
#     [--include-remainder]` prints the new partition's id as sm_partition add does; `partition delete
#     --partition=ID|NAME` (refused while clients run in it, as sm_partition rm, or while a namespace's
#     devices table names it); `partition list
#     [--device=DEV]`'s columns ID NAME DEVICE CHUNKS SMS FIRST_SM SERVER CLIENTS (NAME and SERVER "-" where
#     none), nothing where there is no partition; on a daemon without static partitioning (-S, or the -a
#     file's partitions) each says so and fails; the same partitions as the legacy sm_partition and lspart
#     (mpsd.daemon.sm_partitions), so a partition made by one is seen, used and removed by the other
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, TypedDict

from mpsd.daemon.control_state import AddRoute, RemoveRoute, Terminate
from mpsd.daemon.control_text import limit_text
from mpsd.daemon.mps_config import parse_limit
from mpsd.daemon.namespaces import DEFAULT, Namespace, cgroup_path, check_name
from mpsd.daemon.sm_partitions import PartitionError, check_partition_name
from mpsd_protocol import V3_MODULES, parse_integer, parse_percentage

if TYPE_CHECKING:
    from mpsd.daemon.control import Control

MODULES = V3_MODULES
READ_ONLY = frozenset({("server", "list"), ("server", "get"), ("client", "list"), ("namespace", "list"),
                       ("namespace", "get"), ("partition", "list")})
SETTINGS = ("active-thread-percentage", "pinned-memory-limit", "client-priority")
_WHICH = "[--server=NAME|--uid=UID|--pid=PID]"
_SELECT = {"server": True, "uid": True, "pid": True}
USAGE = {
    ("server", None): "Usage: server <list|create|delete|set|get> [options]",
    ("server", "list"): "Usage: server list",
    ("server", "create"): "Usage: server create --uid=UID",
    ("server", "delete"): "Usage: server delete --pid=PID [--force]",
    ("server", "set"): "Usage: server set [--pid=PID] [--device=DEV] [--active-thread-percentage=PCT] "
                       "[--pinned-memory-limit=LIMIT] [--client-priority=0|1]",
    ("server", "get"): "Usage: server get [--pid=PID] [--device=DEV] "
                       "--active-thread-percentage|--pinned-memory-limit|--client-priority",
    ("client", None): "Usage: client <list|terminate> [options]",
    ("client", "list"): "Usage: client list [--all]",
    ("client", "terminate"): "Usage: client terminate --pid=PID",
    ("namespace", None): "Usage: namespace <list|create|delete|set|get> [options]",
    ("namespace", "list"): f"Usage: namespace list {_WHICH}",
    ("namespace", "create"): f"Usage: namespace create {_WHICH} --name=NAME [--active-thread-percentage=PCT] "
                             "[--pinned-memory-limit=LIMIT] [--client-priority=0|1] [--cgroup=PATH]",
    ("namespace", "delete"): f"Usage: namespace delete {_WHICH} --name=NAME",
    ("namespace", "set"): f"Usage: namespace set {_WHICH} --name=NAME [--active-thread-percentage=PCT] "
                          "[--pinned-memory-limit=LIMIT] [--client-priority=0|1] [--cgroup=PATH]",
    ("namespace", "get"): f"Usage: namespace get {_WHICH} --name=NAME "
                          "--active-thread-percentage|--pinned-memory-limit|--client-priority|--cgroup",
    ("partition", None): "Usage: partition <list|create|delete> [options]",
    ("partition", "list"): "Usage: partition list [--device=DEV]",
    ("partition", "create"): "Usage: partition create --device=DEV --chunks=N [--name=NAME] [--include-remainder]",
    ("partition", "delete"): "Usage: partition delete --partition=ID|NAME",
}
# The options each command takes, and whether each takes a value.
OPTIONS: dict[tuple[str, str], dict[str, bool]] = {
    ("server", "list"): {},
    ("server", "create"): {"uid": True},
    ("server", "delete"): {"pid": True, "force": False},
    ("server", "set"): {"pid": True, "device": True, **{name: True for name in SETTINGS}},
    ("server", "get"): {"pid": True, "device": True, **{name: False for name in SETTINGS}},
    ("client", "list"): {"all": False},
    ("client", "terminate"): {"pid": True},
    ("namespace", "list"): _SELECT,
    ("namespace", "create"): {**_SELECT, "name": True, "cgroup": True, **{name: True for name in SETTINGS}},
    ("namespace", "delete"): {**_SELECT, "name": True},
    ("namespace", "set"): {**_SELECT, "name": True, "cgroup": True, **{name: True for name in SETTINGS}},
    ("namespace", "get"): {**_SELECT, "name": True, "cgroup": False, **{name: False for name in SETTINGS}},
    ("partition", "list"): {"device": True},
    ("partition", "create"): {"device": True, "chunks": True, "name": True, "include-remainder": False},
    ("partition", "delete"): {"partition": True},
}


class Failure(Exception):
    """The command failed: its message is what the tool prints (on stderr), and the tool exits 1."""


def _brief(text: str) -> str:
    return text if len(text) <= 24 else text[:20] + "..."


def parse_options(words: list[str], known: dict[str, bool], usage: str) -> dict[str, str | None]:
    """--name=value, --name value (where the option takes one) and --flag, each at most once."""
    options: dict[str, str | None] = {}
    i = 0
    while i < len(words):
        word = words[i]
        i += 1
        if not word.startswith("--"):
            raise Failure(f'Unexpected argument "{_brief(word)}"\n{usage}')
        name, equals, value = word[2:].partition("=")
        if name not in known:
            raise Failure(f'Unknown option "--{_brief(name)}"\n{usage}')
        if name in options:
            raise Failure(f'Option "--{name}" given twice\n{usage}')
        if known[name] and not equals:
            if i == len(words):
                raise Failure(f'Option "--{name}" needs a value\n{usage}')
            value, i = words[i], i + 1
        elif not known[name] and equals:
            raise Failure(f'Option "--{name}" takes no value\n{usage}')
        options[name] = value if known[name] else None
    return options


def _number(text: str, what: str) -> int:
    try:
        return parse_integer(text)
    except ValueError:
        raise Failure(f'Invalid {what} "{_brief(text)}"') from None


class _Settings(TypedDict, total=False):
    """A namespace's settings given in a command, as Namespace's fields (each one given or left out)."""

    active_thread_percentage: float
    pinned_memory_limit: int | None
    client_priority: int
    cgroup: str


def _percentage(text: str) -> float:
    value = parse_percentage(text)
    if value is None:
        raise Failure(f'Invalid active thread percentage "{_brief(text)}", expected between (0.0, 100.0]')
    return value


def _limit(text: str) -> int:
    """A pinned memory limit as v2 writes one, strictly: a number of MiB, or of GiB with G; 0 is none."""
    try:
        return parse_limit(text)
    except ValueError:
        raise Failure(f'Invalid pinned memory limit "{_brief(text)}", expected e.g. 900M or 10G') from None


def _priority(text: str) -> int:
    if text not in ("0", "1"):
        raise Failure(f'Invalid client priority "{_brief(text)}", expected 0 or 1')
    return int(text)


class V3:
    """The module-verb commands of one daemon's control plane (`control`, whose state they share)."""

    def __init__(self, control: Control) -> None:
        self.control = control

    def run(self, module: str, args: list[str], uid: int) -> tuple[str, bool]:
        """The answer to `module` with `args` from a user `uid`, and whether the command failed."""
        try:
            return self._run(module, args, uid), False
        except Failure as exc:
            return str(exc), True

    def _run(self, module: str, args: list[str], uid: int) -> str:
        verb = args[0] if args else None
        key = (module, verb)
        if verb is None or key not in OPTIONS:
            lead = f'Unknown command "{module} {_brief(verb)}"\n' if verb is not None else ""
            raise Failure(lead + USAGE[(module, None)])
        state = self.control.state
        if key not in READ_ONLY and uid not in (0, state.owner_uid):
            self.control.out.control(f"User {uid} is not allowed to run {module} {verb}")
            raise Failure(f"Permission denied: {module} {verb} needs root or the daemon's owner")
        if module == "partition" and state.partitions is None:
            raise Failure("Static SM partitioning is off: start the daemon with -S, or give SM partitions in the "
                          "-a file")
        command: Callable[[dict[str, str | None], int], str] = getattr(self, f"{module}_{verb}")
        return command(parse_options(args[1:], OPTIONS[key], USAGE[key]), uid)

    # -- helpers -------------------------------------------------------------------------------------------
    def _server(self, options: dict[str, str | None]):
        """The running server --pid names, or None for the defaults where there is no --pid."""
        text = options.get("pid")
        if text is None:
            return None
        pid = _number(text, "PID")
        server = self.control.state.server
        if pid != server.pid or not server.started:
            raise Failure(f"Server {pid} not found")
        return server

    def _devices(self, options: dict[str, str | None]) -> list[int]:
        text = options.get("device")
        count = len(self.control.state.devices)
        if text is None:
            return list(range(count))
        device = _number(text, "device")
        if device >= count:
            raise Failure(f'Invalid device "{_brief(text)}"')
        return [device]

    # -- server -------------------------------------------------------------------------------------------
    def server_list(self, options: dict[str, str | None], uid: int) -> str:
        server = self.control.state.server
        rows: list[tuple[object, ...]] = []
        if server.started:
            faulted = any(device.faulted for device in self.control.state.devices)
            status = "FAULT" if faulted else "SHUTTING_DOWN" if server.shutting_down else "ACTIVE"
            rows.append((server.name or "-", server.pid, "-" if server.uid is None else server.uid, status))
        for named in self.control.state.named.values():  # the -a file's servers that do not run now
            if not (server.started and server.name == named.name):
                rows.append((named.name, "-", named.uid, "INACTIVE"))
        if not rows:
            return ""
        rows.insert(0, ("NAME", "PID", "UID", "STATUS"))
        return "\n".join(f"{name!s:<15}{pid!s:<10}{user!s:<10}{state}" for name, pid, user, state in rows)

    def server_create(self, options: dict[str, str | None], uid: int) -> str:
        text = options.get("uid")
        if text is None:
            raise Failure("A user id (UID) is required to start a new server\n" + USAGE[("server", "create")])
        user = _number(text, "user id")
        if user >= (1 << 32) - 1:  # what setuid refuses
            raise Failure(f'Invalid user id "{_brief(text)}"')
        # v2's start_server: where another user's server has clients, this one waits its turn as a client of
        # that user would (mpsd plays one server at a time).
        self.control.cmd_start_server(["-uid", str(user)])
        return ""

    def server_delete(self, options: dict[str, str | None], uid: int) -> str:
        if options.get("pid") is None:
            raise Failure(USAGE[("server", "delete")])
        self._server(options)
        self.control.servers.try_shutdown("force" in options, self.control.now)
        return ""

    def server_set(self, options: dict[str, str | None], uid: int) -> str:
        given = [name for name in SETTINGS if name in options]
        if not given:
            raise Failure(USAGE[("server", "set")])
        server = self._server(options)
        devices = self._devices(options)
        if "device" in options and "pinned-memory-limit" not in options:
            raise Failure('Option "--device" goes with --pinned-memory-limit\n' + USAGE[("server", "set")])
        # Every value is checked before any is set: a command that fails changes nothing.
        percentage = (_percentage(options["active-thread-percentage"] or "")
                      if "active-thread-percentage" in given else None)
        limit = _limit(options["pinned-memory-limit"] or "") if "pinned-memory-limit" in given else None
        priority = _priority(options["client-priority"] or "") if "client-priority" in given else None
        settings, log = self.control.state.settings, self.control.out
        if percentage is not None:
            if server is None:
                settings.active_thread_percentage = percentage
            else:
                server.active_thread_percentage = percentage
        if limit is not None:
            limits = settings.pinned_mem_limits if server is None else server.pinned_mem_limits
            for device in devices:
                if limit:
                    limits[device] = limit
                else:
                    limits.pop(device, None)
                if server is not None:
                    log.server(f"Device pinned memory limit for device {device} set to {limit:#x} bytes")
        if priority is not None:
            # mpsd gives every incoming client the daemon's client priority, the running server's clients too
            # (v2's set_default_client_priority does the same): one setting for both; a named server's own
            # (its user's, from the -a file) is that server's.
            if server is not None and server.uid is not None and ("uid", server.uid) in settings.priorities:
                settings.priorities[("uid", server.uid)] = priority
            else:
                settings.client_priority = priority
        return ""

    def server_get(self, options: dict[str, str | None], uid: int) -> str:
        asked = [name for name in SETTINGS if name in options]
        if len(asked) != 1:
            raise Failure(USAGE[("server", "get")])
        server = self._server(options)
        devices = self._devices(options)
        (name,) = asked
        if "device" in options and name != "pinned-memory-limit":
            raise Failure('Option "--device" goes with --pinned-memory-limit\n' + USAGE[("server", "get")])
        settings = self.control.state.settings
        if name == "active-thread-percentage":
            value = (settings.active_thread_percentage if server is None
                     else self.control.admission.percentage_for_new_client())
            return f"{value:.1f}"
        if name == "client-priority":
            if server is not None and server.uid is not None:
                return str(settings.priority_for(-1, server.uid))
            return str(settings.client_priority)
        limits = settings.pinned_mem_limits if server is None else server.pinned_mem_limits
        if "device" in options:
            limit = limits.get(devices[0])
            return "" if limit is None else limit_text(limit)
        return "\n".join(f"{device}={limit_text(limits[device])}" for device in devices if device in limits)

    # -- client -------------------------------------------------------------------------------------------
    def client_list(self, options: dict[str, str | None], uid: int) -> str:
        control = self.control
        everyone = uid in (0, control.state.owner_uid)  # others see their own processes only, as v2's ps
        route = control.route  # asked by a routed socket: that server's namespace's clients only
        rows: list[tuple[object, ...]] = []
        if control.state.server.started:
            processes: dict[int, list] = {}
            for pid, contexts in control.state.processes_of_server().items():
                if route is not None:
                    contexts = [ctx for ctx in contexts if control.state.server_key(ctx.uid) == route.uid
                                and ctx.namespace == route.namespace]
                if contexts:
                    processes[pid] = contexts
            for pid, mine in processes.items():
                if everyone or mine[0].uid == uid:
                    uuids = ",".join(dict.fromkeys(ctx.device.properties["uuid"] for ctx in mine))
                    rows.append((pid, control.state.server.pid, mine[0].uid, "ACTIVE", mine[0].namespace, uuids))
        if "all" in options:
            for pid, user in control.state.waiting:
                if (everyone or user == uid) and (route is None or route.uid in (None, control.state.server_key(user))):
                    rows.append((pid, "-", user, "PENDING", "-", "-"))
        if not rows:
            return ""
        rows.insert(0, ("PID", "SERVER", "UID", "STATUS", "NAMESPACE", "DEVICE"))
        return "\n".join(f"{pid!s:<10}{server!s:<10}{user!s:<10}{state!s:<10}{space!s:<15}{device}"
                         for pid, server, user, state, space, device in rows)

    def client_terminate(self, options: dict[str, str | None], uid: int) -> str:
        text = options.get("pid")
        if text is None:
            raise Failure(USAGE[("client", "terminate")])
        pid = _number(text, "PID")
        control = self.control
        victims = control.state.processes_of_server().get(pid, []) if control.state.server.started else []
        if not victims:
            raise Failure(f"Invalid process {pid}")
        for n, ctx in enumerate(victims, 1):
            control.out.server(f"MPS server requesting client {{PID: {pid}, Context ID: {n}}} to exit")
            control.out.do(Terminate(ctx, "terminate_client"))
            control.state.terminated.add(ctx.id)
            control.out.server("Client termination succeeded.")
        return ""

    # -- namespace ----------------------------------------------------------------------------------------
    def _which_server(self, options: dict[str, str | None], usage: str) -> tuple[int | None, str | None]:
        """The server a namespace command is about (its namespaces' key, its name if it is a named one):
        --server, --uid or --pid, else the one the routed control socket leads to, else the running one."""
        control = self.control
        given = [name for name in _SELECT if name in options]
        if len(given) > 1:
            raise Failure("Give one of --server, --uid and --pid\n" + usage)
        if "server" in options:
            name = options["server"] or ""
            named = next((n for n in control.state.named.values() if n.name == name), None)
            if named is None:
                raise Failure(f'Server "{_brief(name)}" not found')
            return control.state.server_key(named.uid), named.name
        if "uid" in options:
            user = _number(options["uid"] or "", "user id")
            named = control.state.named.get(user)
            return control.state.server_key(user), None if named is None else named.name
        if "pid" in options:
            server = self._server(options)
            return control.state.server_key(server.uid), server.name
        if control.route is not None:
            return control.route.uid, control.route.server
        if control.state.server.started:
            return control.state.server_key(control.state.server.uid), control.state.server.name
        raise Failure("No server given and none is running: give --server=NAME, --uid=UID or --pid=PID\n" + usage)

    def _namespace(self, options: dict[str, str | None], usage: str, key: int | None) -> Namespace | None:
        """The namespace --name names (None: the server's default one), or the routed socket's."""
        name = options.get("name")
        if name is None:
            route = self.control.route
            if route is None or route.namespace == DEFAULT or route.uid != key:
                raise Failure(usage)
            name = route.namespace
        if name == DEFAULT:
            return None
        found = self.control.state.namespaces.get(key, {}).get(name)
        if found is None:
            raise Failure(f'Namespace "{_brief(name)}" not found')
        return found

    def _clients_in(self, key: int | None, name: str) -> int:
        control = self.control
        return len({ctx.pid for ctx in control.state.contexts()
                    if control.state.server_key(ctx.uid) == key and ctx.namespace == name})

    @staticmethod
    def _settings(options: dict[str, str | None]) -> _Settings:
        """The settings given, checked (a command that fails changes nothing); a limit of 0 is none."""
        out: _Settings = {}
        if "active-thread-percentage" in options:
            out["active_thread_percentage"] = _percentage(options["active-thread-percentage"] or "")
        if "pinned-memory-limit" in options:
            out["pinned_memory_limit"] = _limit(options["pinned-memory-limit"] or "") or None
        if "client-priority" in options:
            out["client_priority"] = _priority(options["client-priority"] or "")
        if "cgroup" in options:
            try:
                out["cgroup"] = cgroup_path(options["cgroup"] or "")
            except ValueError as exc:
                raise Failure(str(exc)) from None
        return out

    def namespace_list(self, options: dict[str, str | None], uid: int) -> str:
        control = self.control
        if any(name in options for name in _SELECT) or control.route is not None:
            servers = [self._which_server(options, USAGE[("namespace", "list")])]
        else:  # every server that has or can have namespaces: the named ones, the running one, the rest
            state = control.state
            known: dict[int | None, str | None] = {state.server_key(n.uid): n.name for n in state.named.values()}
            if control.state.server.started:
                known.setdefault(control.state.server_key(control.state.server.uid), control.state.server.name)
            for key in control.state.namespaces:
                known.setdefault(key, None)
            servers = list(known.items())
        rows: list[tuple[object, ...]] = []
        for key, name in servers:
            for space in [DEFAULT, *control.state.namespaces.get(key, {})]:
                rows.append((name or "-", "-" if key is None else key, space, self._clients_in(key, space)))
        if not rows:
            return ""
        rows.insert(0, ("SERVER", "UID", "NAMESPACE", "CLIENTS"))
        return "\n".join(f"{server!s:<15}{user!s:<10}{space!s:<15}{count}" for server, user, space, count in rows)

    def namespace_create(self, options: dict[str, str | None], uid: int) -> str:
        usage = USAGE[("namespace", "create")]
        key, server = self._which_server(options, usage)
        if options.get("name") is None:
            raise Failure(usage)
        try:
            name = check_name(options["name"] or "")
        except ValueError as exc:
            raise Failure(str(exc)) from None
        spaces = self.control.state.namespaces.setdefault(key, {})
        if name in spaces:
            raise Failure(f'Namespace "{name}" already exists')
        namespace = Namespace(name, **self._settings(options))
        spaces[name] = namespace
        if server is not None:  # a named server's namespace has its sockets: $PIPE/<server>/<namespace>/
            self.control.out.do(AddRoute(server, key, name))
        self.control.out.control(f"Namespace {name} created for server {server or key}")
        return ""

    def namespace_delete(self, options: dict[str, str | None], uid: int) -> str:
        usage = USAGE[("namespace", "delete")]
        key, server = self._which_server(options, usage)
        namespace = self._namespace(options, usage, key)
        if namespace is None:
            raise Failure(f'The "{DEFAULT}" namespace goes only with its server')
        count = self._clients_in(key, namespace.name)
        if count:
            raise Failure(f'Namespace "{namespace.name}" has {count} client(s)')
        if server is not None:
            self.control.out.do(RemoveRoute(server, key, namespace.name))
        del self.control.state.namespaces[key][namespace.name]
        self.control.out.control(f"Namespace {namespace.name} of server {server or key} deleted")
        return ""

    def namespace_set(self, options: dict[str, str | None], uid: int) -> str:
        usage = USAGE[("namespace", "set")]
        key, _ = self._which_server(options, usage)
        namespace = self._namespace(options, usage, key)
        settings = self._settings(options)
        if not settings:
            raise Failure(usage)
        if namespace is None:
            raise Failure(f'The "{DEFAULT}" namespace is its server: use server set')
        for field_name, value in settings.items():  # for its clients created afterwards, as v2's settings
            setattr(namespace, field_name, value)
        return ""

    def namespace_get(self, options: dict[str, str | None], uid: int) -> str:
        usage = USAGE[("namespace", "get")]
        asked = [name for name in (*SETTINGS, "cgroup") if name in options]
        if len(asked) != 1:
            raise Failure(usage)
        key, _ = self._which_server(options, usage)
        namespace = self._namespace(options, usage, key) or Namespace(DEFAULT)  # the default: the server's
        control, (name,) = self.control, asked
        # What a client that comes now gets in it, inside its server's settings.
        if name == "active-thread-percentage":
            return f"{namespace.percentage(control.admission.percentage_for_new_client(key)):.1f}"
        if name == "client-priority":
            base = (control.state.settings.client_priority if key is None
                    else control.state.settings.priority_for(-1, key))
            return str(namespace.priority(base))
        if name == "cgroup":
            return namespace.cgroup or ""
        lines = []
        for device in range(len(control.state.devices)):
            limit = namespace.memory_limit(control.admission.memory_limit_for_new_client(device, key))
            if limit is not None:
                lines.append(f"{device}={limit_text(limit)}")
        return "\n".join(lines)

    # -- partition (the static SM partitions the legacy sm_partition and lspart keep) -----------------------
    def _device(self, text: str) -> int:
        """A device by index or GPU UUID, of the daemon's."""
        found = next((d.index for d in self.control.state.devices if text in (str(d.index), d.properties["uuid"])),
                     None)
        if found is None:
            raise Failure(f'Invalid device "{_brief(text)}"')
        return found

    def partition_list(self, options: dict[str, str | None], uid: int) -> str:
        control = self.control
        device = None if options.get("device") is None else self._device(options["device"] or "")
        partitions = control.state.partitions
        assert partitions is not None  # (the partition module answers only under static partitioning: _run)
        rows: list[tuple[object, ...]] = [
            (p.id, p.name or "-", control.state.devices[p.device].properties["uuid"], p.chunks, p.sm_count,
             p.first_sm, p.server or "-", control.partitions.sm_partition_clients(p))
            for p in partitions.partitions.values() if device in (None, p.device)]
        if not rows:
            return ""
        rows.insert(0, ("ID", "NAME", "DEVICE", "CHUNKS", "SMS", "FIRST_SM", "SERVER", "CLIENTS"))
        return "\n".join(f"{pid!s:<8}{name!s:<15}{uuid!s:<44}{chunks!s:<8}{sms!s:<6}{first!s:<10}{server!s:<15}"
                         f"{users}" for pid, name, uuid, chunks, sms, first, server, users in rows)

    def partition_create(self, options: dict[str, str | None], uid: int) -> str:
        usage = USAGE[("partition", "create")]
        if options.get("device") is None or options.get("chunks") is None:
            raise Failure(usage)
        device = self._device(options["device"] or "")
        chunks = _number(options["chunks"] or "", "number of chunks")
        name = options.get("name")
        try:
            if name is not None:
                check_partition_name(name)
            partition = self.control.partitions.add_sm_partition(device, chunks, name=name,
                                                      include_remainder="include-remainder" in options)
        except (ValueError, PartitionError) as exc:
            raise Failure(str(exc)) from None
        return partition.id

    def partition_delete(self, options: dict[str, str | None], uid: int) -> str:
        if options.get("partition") is None:
            raise Failure(USAGE[("partition", "delete")])
        try:
            self.control.partitions.remove_sm_partition(options["partition"] or "")
        except PartitionError as exc:
            raise Failure(str(exc)) from None
        return ""
