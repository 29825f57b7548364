"""Each region's Hivemind address is its own (`ray_diloco.network`): flags for the region a driver runs, the
settings that cannot work refused in one line, and the warning for addresses no other network can dial."""

import pytest

from ray_diloco.config import ConfigError, ExperimentConfig
from ray_diloco.network import check_driver_ports, reach, reach_warning, region_network

RUN_YAML = "regions: [{name: us}, {name: eu}, {name: ap}]\n"


def config(argv, text=RUN_YAML, tmp_path=None):
    from ray_diloco.cli import build_parser, resolve_config

    path = tmp_path / "run.yaml"
    path.write_text(text)
    return resolve_config(build_parser().parse_args(["train", "--config", str(path), *argv]))


def test_the_flags_set_the_address_of_the_region_this_driver_runs_only(tmp_path):
    cfg = config(["--local-regions", "eu", "--listen-host", "0.0.0.0", "--port", "31337", "--announce",
                  "/ip4/203.0.113.7/tcp/31337"], tmp_path=tmp_path)
    eu, us = region_network(cfg, "eu"), region_network(cfg, "us")
    assert (eu.host, eu.port, eu.announce) == ("0.0.0.0", 31337, ("/ip4/203.0.113.7/tcp/31337",))
    assert eu.pinned  # its SyncActor runs on the driver's node, where the address points
    assert (us.host, us.port, us.announce) == ("127.0.0.1", 0, ()) and not us.pinned
    # The same file in another cluster, with that cluster's own flags.
    ap = config(["--local-regions", "ap", "--port", "31338"], tmp_path=tmp_path)
    assert region_network(ap, "ap").port == 31338 and region_network(ap, "eu").port == 0


@pytest.mark.parametrize("argv, text, message", [
    (["--port", "31337"], RUN_YAML, r"^--port: names one region's address, but this driver runs regions "),
    (["--local-regions", "eu", "--port", "70000"], RUN_YAML, r"^--port: must be a TCP port"),
    (["--local-regions", "eu", "--announce", "203.0.113.7:31337"], RUN_YAML,
     r"^regions\[eu\]\.announce: '203.0.113.7:31337' is not a multiaddr"),
    (["--local-regions", "eu", "--announce", "/ip4/203.0.113/tcp/31337"], RUN_YAML, r"is not an ip4 address"),
    (["--local-regions", "eu", "--announce", "/ip4/203.0.113.7"], RUN_YAML, r"is not a multiaddr"),
    ([], RUN_YAML + "outer: {announce: [/ip4/203.0.113.7/tcp/31337]}\n",
     r"^outer\.announce: regions \['us', 'eu', 'ap'\] would all advertise"),
])
def test_settings_that_cannot_work_are_one_line_naming_the_field(tmp_path, argv, text, message):
    with pytest.raises(ConfigError, match=message) as error:
        config(argv, text, tmp_path)
    assert "\n" not in str(error.value)


def test_a_run_wide_announce_is_fine_for_a_region_alone_and_per_region_fields_load():
    ExperimentConfig.from_yaml("regions: [{name: us}]\nouter: {announce: [/ip4/203.0.113.7/tcp/31337]}")
    cfg = ExperimentConfig.from_yaml("regions: [{name: us, port: 31337, announce: [/dns4/us.example.org/tcp/31337]},"
                                     " {name: eu, port: 31338, host: 0.0.0.0}]")
    assert region_network(cfg, "us").announce == ("/dns4/us.example.org/tcp/31337",)
    assert region_network(cfg, "eu").host == "0.0.0.0"


def test_what_another_network_can_dial():
    assert reach(["/ip4/127.0.0.1/tcp/1/p2p/Qm"]) == "loopback"
    assert reach(["/ip4/127.0.0.1/tcp/1", "/ip4/10.0.0.5/tcp/1", "/ip4/100.64.1.1/tcp/1"]) == "private"
    assert reach(["/ip4/10.0.0.5/tcp/1", "/ip4/34.120.1.7/tcp/31337"]) == "public"
    assert reach(["/ip4/203.0.113.7/tcp/31337"]) == "private"  # a documentation range is not routed
    assert reach(["/dns4/us.example.org/tcp/31337"]) == "public"
    assert reach(["/ip6/::1/tcp/1"]) == "loopback"
    warning = reach_warning("eu", ["/ip4/127.0.0.1/tcp/1"])
    assert warning.count("\n") == 0 and "--listen-host 0.0.0.0" in warning and "--announce" in warning
    assert "--announce" in reach_warning("eu", ["/ip4/192.168.1.4/tcp/1"])
    assert reach_warning("eu", ["/ip4/34.120.1.7/tcp/31337"]) is None


@pytest.mark.parametrize("text", ["regions: [{name: us, port: 31337}, {name: eu, port: 31337}]\n",
                                  "regions: [{name: us}, {name: eu}]\nouter: {port: 31337}\n"])
def test_one_fixed_port_is_refused_only_for_a_driver_running_two_regions_on_it(tmp_path, text):
    # The shared file loads (each cluster runs one region on its own head) ...
    check_driver_ports(config(["--local-regions", "eu"], text, tmp_path))
    # ... but one driver running both would start two SyncActors on one port of its node.
    with pytest.raises(ConfigError, match=r"^regions\[eu\]\.port: 31337 is region us's too") as error:
        check_driver_ports(config([], text, tmp_path))
    assert "\n" not in str(error.value)
