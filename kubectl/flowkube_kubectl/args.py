"""`kubectl flow`'s command line: flags anywhere, kubectl style, checked before anything runs."""

from __future__ import annotations

from dataclasses import dataclass, field

_KUBE_VALUE_FLAGS = {"-n": "--namespace", "-s": "--server"} | {
    f: f for f in ("--namespace", "--context", "--kubeconfig", "--cluster", "--user", "--as", "--as-group",
                   "--request-timeout", "--server", "--token", "--certificate-authority")}


_KUBE_BOOL_FLAGS = {"--insecure-skip-tls-verify"}


_SHORT_VALUE_FLAGS = {"-n", "-s", "-p"}  # also -nNAME and -n=NAME, as kubectl takes them


# Repeatable flags, each value kept in order: the flag (as written) -> its long name (Args.lists' key)
_LIST_FLAGS = {"-p": "--param", "--param": "--param", "--input": "--input", "--output": "--output"}


_LIST_FLAG_COMMANDS = {"--param": "run-template", "--input": "fork", "--output": "fork"}


# command: (positionals, least of them, its own flags)
_COMMANDS: dict[str, tuple[str, int, frozenset[str]]] = {
    "get": ("[NAME]", 0, frozenset()),
    "feedback": ("NAME TEXT", 2, frozenset({"--request-id"})),
    "say": ("NAME TEXT", 2, frozenset({"--timeout"})),
    "chat": ("NAME", 1, frozenset({"--timeout"})),
    "console": ("", 0, frozenset({"--port", "--no-browser"})),
    "run-template": ("TEMPLATE", 1, frozenset({"--name", "--generate-name", "--cluster-template", "--dry-run"})),
    "trigger": ("CRONFLOW", 1, frozenset({"--name", "--dry-run"})),
    "fork": ("NAME", 1, frozenset({"--at", "--name", "--from-namespace", "--dry-run"})),
    "quota": ("[NAME]", 0, frozenset()),
}


_BOOL_COMMAND_FLAGS = frozenset({"--no-browser", "--generate-name", "--cluster-template", "--dry-run"})


_OFF = ("false", "0", "none")  # a boolean flag's values that turn it off (--dry-run=none as in kubectl)


_COMMAND_FLAGS = frozenset().union(*(spec[2] for spec in _COMMANDS.values()))


class UsageError(Exception):
    pass


@dataclass
class Args:
    cmd: str = ""
    pos: list[str] = field(default_factory=list)
    opts: dict[str, str] = field(default_factory=dict)
    kube: list[str] = field(default_factory=list)  # kubectl's global flags, as --flag=value
    lists: dict[str, list[str]] = field(default_factory=dict)  # repeatable flags' values, in order, by long name
    all_namespaces: bool = False
    help: bool = False

    @property
    def params(self) -> list[str]:
        """run-template's -p/--param KEY=VALUE, in order."""
        return self.lists.get("--param", [])


def parse(argv: list[str]) -> Args:
    """Flags anywhere, kubectl style; positionals in order, the first one is the command."""
    a, i = Args(), 0
    while i < len(argv):
        tok, i = argv[i], i + 1
        if tok == "--":
            a.pos += argv[i:]
            break
        if not tok.startswith("-") or tok == "-":
            a.pos.append(tok)
            continue
        i = _take_flag(a, tok, argv, i)
    if not a.help:
        _check(a)
    return a


def _split(tok: str) -> tuple[str, str, str]:
    """(flag, "=" or "", value) of ``--flag=value``, ``-nNAMESPACE`` or ``-n=NAMESPACE``."""
    if tok[:2] in _SHORT_VALUE_FLAGS and len(tok) > 2:
        return tok[:2], "=", tok[2:].removeprefix("=")
    return tok.partition("=")


def _take_flag(a: Args, tok: str, argv: list[str], i: int) -> int:
    """Record the flag ``tok`` (its value from the next argument if it needs one and has no ``=``);
    returns the index of the argument after it."""
    flag, eq, value = _split(tok)
    if flag in ("-h", "--help"):
        a.help = True
    elif flag in ("-A", "--all-namespaces"):
        a.all_namespaces = value.lower() not in ("false", "0")
    elif flag in _KUBE_BOOL_FLAGS:
        a.kube.append(tok)
    elif flag in _BOOL_COMMAND_FLAGS:
        a.opts[flag] = value or "true"
    elif flag in _KUBE_VALUE_FLAGS or flag in _COMMAND_FLAGS or flag in _LIST_FLAGS:
        if not eq:
            if i == len(argv):
                raise UsageError(f"flag {flag} needs a value")
            value, i = argv[i], i + 1
        if flag in _LIST_FLAGS:
            a.lists.setdefault(_LIST_FLAGS[flag], []).append(value)
        elif flag in _KUBE_VALUE_FLAGS:
            a.kube.append(f"{_KUBE_VALUE_FLAGS[flag]}={value}")
        else:
            a.opts[flag] = value
    else:
        raise UsageError(f"unknown flag {flag} (put -- before a TEXT that starts with -)")
    return i


def _check(a: Args) -> None:
    if not a.pos:
        raise UsageError(f"missing command: one of {', '.join(_COMMANDS)}")
    a.cmd, *a.pos = a.pos
    if a.cmd not in _COMMANDS:
        raise UsageError(f"unknown command {a.cmd!r}: one of {', '.join(_COMMANDS)}")
    usage, least, flags = _COMMANDS[a.cmd]
    if not least <= len(a.pos) <= len((usage or "").split()):
        raise UsageError(f"usage: kubectl flow {a.cmd} {usage} (got {len(a.pos)} arguments: {a.pos})")
    for flag in a.opts:
        if flag not in flags:
            raise UsageError(f"unknown flag {flag} for {a.cmd}")
    for flag, values in a.lists.items():
        if values and _LIST_FLAG_COMMANDS[flag] != a.cmd:
            raise UsageError(f"unknown flag {'-p/--param' if flag == '--param' else flag} for {a.cmd}")
    if a.all_namespaces and (a.cmd not in ("get", "quota") or a.pos):
        raise UsageError("-A/--all-namespaces only applies to `kubectl flow get` and `kubectl flow quota` without NAME")
    _check_values(a)


def _check_values(a: Args) -> None:
    try:
        if not float(a.opts.get("--timeout", 0)) >= 0:
            raise ValueError
    except ValueError:
        raise UsageError(f"--timeout needs a number of seconds, got {a.opts['--timeout']!r}") from None
    if not a.opts.get("--port", "0").isdigit() or int(a.opts.get("--port", "0")) > 65535:
        raise UsageError(f"--port needs a port number, got {a.opts['--port']!r}")
    if "--name" in a.opts and (not a.opts["--name"] or flag_on(a, "--generate-name")):
        raise UsageError("--name needs a name, and goes without --generate-name")
    if a.opts.get("--dry-run", "true").lower() not in ("true", "1", "client", *_OFF):
        raise UsageError(f"--dry-run is client-side only (--dry-run or --dry-run=client), got {a.opts['--dry-run']!r}")
    at = a.opts.get("--at", "")
    if a.cmd == "fork" and not (at.isascii() and at.isdigit()):
        raise UsageError("fork needs --at CHECKPOINT, the id of one of the Flow's checkpoints (kubectl flow get NAME "
                         f"lists them){', got ' + repr(a.opts['--at']) if '--at' in a.opts else ''}")
    if a.opts.get("--from-namespace") == "":
        raise UsageError("--from-namespace needs a namespace")


def flag_on(a: Args, flag: str) -> bool:
    return a.opts.get(flag, "false").lower() not in _OFF


def namespace_of(a: Args) -> str:
    """The -n/--namespace given (the last one, as kubectl takes it), or "" for kubeconfig's."""
    return next((k.partition("=")[2] for k in reversed(a.kube) if k.startswith("--namespace=")), "")
