"""Where each region's Hivemind node listens, and what it tells the other regions to dial.

A run spans Ray clusters, one per region, each behind its own address, and one config (the same file in every
cluster) lists them all. So the address settings are per region: `regions[].host`, `.port`, `.announce` (set by
the `--listen-host`, `--port`, `--announce` flags of the driver that runs the region) override the run-wide
`outer.host`, `outer.port`, `outer.announce`. A run-wide announced address is refused when the run has several
regions: every region would advertise the same head.

An address names a machine, so a region whose port is fixed or whose address is announced keeps its SyncActor on
the driver's node (the head under `ray job submit`, where a cloud's firewall rule, a NAT forward or a Kubernetes
Service points); any other region's SyncActor may run on any of its nodes.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from ray_diloco.config import ConfigError, ExperimentConfig


@dataclass(frozen=True)
class Network:
    host: str
    port: int  # 0: any free port
    announce: tuple[str, ...]

    @property
    def pinned(self) -> bool:
        """The others are told a fixed address: the SyncActor must be where it points (the driver's node)."""
        return self.port != 0 or bool(self.announce)


def region_network(cfg: ExperimentConfig, region: str) -> Network:
    settings = next(r for r in cfg.regions if r.name == region)
    outer = cfg.outer
    return Network(host=settings.host if settings.host is not None else outer.host,
                   port=settings.port if settings.port is not None else outer.port,
                   announce=tuple(settings.announce if settings.announce is not None else outer.announce))


def check_network(cfg: ExperimentConfig) -> None:
    """One-line ConfigErrors for settings that cannot work in any cluster: one announced address for several
    regions, an announced address that is no multiaddr (checked when the config loads)."""
    shared = [r.name for r in cfg.regions if r.announce is None]
    if cfg.outer.announce and len(cfg.regions) > 1 and shared:
        raise ConfigError(f"outer.announce: regions {shared} would all advertise {cfg.outer.announce}; give each "
                          "region its own (regions[].announce, or --announce in the cluster that runs it)")
    for region in cfg.regions:
        for address in region_network(cfg, region.name).announce:
            _check_multiaddr(address, f"regions[{region.name}].announce")


def check_driver_ports(cfg: ExperimentConfig) -> None:
    """Two regions this driver runs may not share a fixed port: their SyncActors both run on its node. Checked
    once the flags are applied (`--local-regions` narrows the config's regions to this cluster's), like
    `check_elastic`: a shared config with one fixed port is fine when each cluster runs one region."""
    taken: dict[int, str] = {}
    for region in cfg.local_regions():
        port = region_network(cfg, region.name).port
        if port and port in taken:
            raise ConfigError(f"regions[{region.name}].port: {port} is region {taken[port]}'s too, and this driver "
                              "runs both on its node; give each region its own port, or run each in its own "
                              "cluster (--local-regions)")
        taken[port] = region.name


_ADDRESS_PROTOCOLS = ("ip4", "ip6", "dns", "dns4", "dns6", "dnsaddr")


def _check_multiaddr(address: str, field_name: str) -> None:
    """An address the others can dial: /<ip4|ip6|dns…>/<address>/<tcp|udp>/<port>[/…]. Checked by hand: importing
    hivemind's multiaddr parser imports all of hivemind (~10 s), too slow for a check before Ray starts."""
    parts = address.split("/")
    problem = None
    if len(parts) < 5 or parts[0] != "" or parts[1] not in _ADDRESS_PROTOCOLS:
        problem = f"give /<{'|'.join(_ADDRESS_PROTOCOLS)}>/<address>/tcp/<port>"
    elif parts[1] in ("ip4", "ip6"):
        try:
            ipaddress.ip_address(parts[2])
        except ValueError:
            problem = f"{parts[2]!r} is not an {parts[1]} address"
    if problem is None and (parts[3] not in ("tcp", "udp") or not parts[4].isdigit() or int(parts[4]) > 65535):
        problem = "its address must be followed by /tcp/<port>"
    if problem:
        raise ConfigError(f"{field_name}: {address!r} is not a multiaddr ({problem}); e.g. /ip4/203.0.113.7/tcp/31337")


def reach(maddrs: list[str]) -> str:
    """'public' if some advertised address may be dialled from another network (a public IP or a DNS name),
    else 'private' or 'loopback' (the widest kind among them)."""
    kinds = set()
    for address in maddrs:
        parts = address.split("/")
        if len(parts) < 3 or parts[1] not in ("ip4", "ip6"):
            return "public"  # /dns4/…, /dns/…: a name the others resolve
        ip = ipaddress.ip_address(parts[2])
        kinds.add("loopback" if ip.is_loopback else "public" if ip.is_global else "private")
    return "public" if "public" in kinds else "private" if "private" in kinds else "loopback"


def reach_warning(region: str, maddrs: list[str]) -> str | None:
    """The one-line warning for a region of a run spanning clusters that advertises no address another network
    can dial, naming the flags that fix it."""
    kind = reach(maddrs)
    if kind == "public":
        return None
    fix = ("--listen-host 0.0.0.0 and --announce /ip4/<public address>/tcp/<port>" if kind == "loopback"
           else "--announce /ip4/<public address>/tcp/<forwarded port> (and --port <that port>)")
    return (f"[driver] warning: region {region} advertises only {kind} addresses {maddrs}: regions in other "
            f"networks cannot dial it; give {fix}")
