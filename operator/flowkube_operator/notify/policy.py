"""Where the operator may send a notification: never this host, link-local, multicast or reserved
addresses; by default not the private ranges; never the cluster's own ranges (its nodes and Service
CIDRs, as the API server tells them); `allowedCIDRs` lets a range through. Checked on the address
each connection is made to, after DNS. Pure."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from flowkube_operator.settings import DEFAULT_DENIED_CIDRS

Body = dict[str, Any]
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address

# -- where the operator may send --------------------------------------------------------------------------

# Never a receiver, whatever a Flow's Secret says: this host, link-local (cloud metadata endpoints
# live there), unspecified, multicast and reserved addresses. Only `allowedCIDRs` lets one through.
ALWAYS_DENIED = tuple(ipaddress.ip_network(n) for n in (
    "0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "224.0.0.0/4", "240.0.0.0/4",
    "::/128", "::1/128", "fe80::/10", "ff00::/8",
))


@dataclass(frozen=True)
class Policy:
    allowed: tuple[IPNetwork, ...] = ()
    denied: tuple[IPNetwork, ...] = tuple(ipaddress.ip_network(n) for n in DEFAULT_DENIED_CIDRS)

    @classmethod
    def of(cls, allowed: Iterable[str], denied: Iterable[str]) -> Policy:
        return cls(tuple(ipaddress.ip_network(n, strict=False) for n in allowed),
                   tuple(ipaddress.ip_network(n, strict=False) for n in denied))

    def denying(self, cidrs: Iterable[str]) -> Policy:
        """This policy, denying ``cidrs`` too (the cluster's own ranges, as the API server tells them)."""
        more = []
        for n in cidrs:
            try:
                more.append(ipaddress.ip_network(n, strict=False))
            except ValueError:
                continue
        return Policy(self.allowed, self.denied + tuple(n for n in more if n not in self.denied))

    def refusal(self, address: str) -> str | None:
        """Why the operator may not connect to ``address`` (an IP), or None when it may."""
        try:
            ip: IPAddress = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return f"{address!r} is not an IP address"
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if any(ip in n for n in self.allowed if n.version == ip.version):
            return None
        for addr in (ip, *_embedded_ipv4(ip)):  # NAT64 and 6to4 addresses lead to an IPv4 one: check it too
            for nets, why in ((ALWAYS_DENIED, "never allowed"),
                              (self.denied, "denied (notifications.deniedCIDRs, or the cluster's own ranges)")):
                for net in nets:
                    if net.version == addr.version and addr in net:
                        return f"{ip} is in {net}, {why} (notifications.allowedCIDRs allows a range)"
        return None


def cluster_ranges(kind: str, obj: Body) -> list[str]:
    """What an object of the cluster says is the cluster's, to deny: a ServiceCIDR's ranges; a Node's
    pod CIDRs and its InternalIP and ExternalIP addresses (its NodePorts and kubelet listen there)."""
    spec = obj.get("spec") or {}
    if kind == "ServiceCIDR":
        return [str(n) for n in spec.get("cidrs") or []]
    out = [str(n) for n in spec.get("podCIDRs") or []]
    out += [str(a.get("address")) for a in (obj.get("status") or {}).get("addresses") or []
            if isinstance(a, dict) and a.get("type") in ("InternalIP", "ExternalIP") and a.get("address")]
    return out


def numeric_host_problem(host: str) -> str | None:
    """A host that is a number to some parser (``2130706433``, ``0x7f.1``, ``127.1``: 127.0.0.1 to the C
    library) and not a dotted-quad IPv4 address: the HTTP client refuses it when it connects, so it is
    refused here first, as the Secret's mistake (an IPv6 literal, with colons, is an address as it is)."""
    last = host.rstrip(".").rsplit(".", 1)[-1].lower()
    hexadecimal = last.startswith("0x") and all(ch in "0123456789abcdef" for ch in last[2:])
    if ":" in host or not (last.isdigit() or hexadecimal):
        return None
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        return "is a number that is not a dotted-quad IPv4 address"
    return None


NAT64 = (ipaddress.ip_network("64:ff9b::/96"), ipaddress.ip_network("64:ff9b:1::/48"))


def _embedded_ipv4(ip: IPAddress) -> list[ipaddress.IPv4Address]:
    if not isinstance(ip, ipaddress.IPv6Address):
        return []
    out = [ip.sixtofour] if ip.sixtofour is not None else []
    if any(ip in n for n in NAT64):
        out.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return out
