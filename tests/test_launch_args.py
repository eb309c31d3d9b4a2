"""The launcher's accelerate arguments: a run on one machine rendezvous on a free port of its own (two
runs side by side do not fight over accelerate's default 29500), a multi-machine config keeps its port;
closing the process group is a no-op in a process that never opened one."""

from __future__ import annotations

import socket

from flowgrpo.trainer.launch import close_process_group, launch_args


def _port(args: list[str]) -> int | None:
    return int(args[args.index("--main_process_port") + 1]) if "--main_process_port" in args else None


def test_a_single_machine_launch_gets_a_free_port_of_its_own(tmp_path):
    args = launch_args(2, ["train.iterations=1"])
    port = _port(args)
    assert port is not None and port != 29500
    with socket.socket() as s:  # free a moment ago: this process can bind it
        s.bind(("127.0.0.1", port))
    assert args[-3:] == ["flowgrpo", "train", "train.iterations=1"]
    single = tmp_path / "one.yaml"
    single.write_text("distributed_type: MULTI_CPU\nnum_machines: 1\n")
    assert _port(launch_args(2, [], str(single))) is not None


def test_a_config_that_names_its_port_or_several_machines_keeps_it(tmp_path):
    named = tmp_path / "named.yaml"
    named.write_text("num_machines: 1\nmain_process_port: 29612\n")
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text("num_machines: 2\n")
    for config in (named, nodes):
        args = launch_args(16, [], str(config))
        assert _port(args) is None and args[:2] == ["--config_file", str(config)]


def test_closing_without_a_process_group_does_nothing():
    import torch.distributed as dist

    close_process_group()
    assert not dist.is_initialized()
