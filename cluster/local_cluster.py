"""Watch raymp's elastic restarts on one machine: a Ray cluster of several nodes (a head and N
worker nodes, each a real raylet with its own worker processes), a training run on it, and
commands to remove and add nodes while it trains.

    python cluster/local_cluster.py configs/tiny-elastic.yaml            # type commands as it trains
    python cluster/local_cluster.py configs/tiny-elastic.yaml --kill-at 15 --add-at 30   # scripted

Commands (stdin): nodes | kill N | add | quit. `kill N` removes worker node N the way a lost
machine goes: its actors die with it, and the run re-plans, restores and carries on.

The driver runs inside this process, next to the cluster: on Ray 2.60 a driver started in another
process against a ray.cluster_utils cluster (every node on one IP) gets its actors refused
("Actor may be already destroyed"), so the two cannot be split here. On a real cluster, run
`raymp train` (or `ray job submit`) as usual and stop a node with `ray stop` on it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a run config, e.g. configs/tiny-elastic.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--nodes", type=int, default=2, help="worker nodes to start (default 2)")
    parser.add_argument("--cpus-per-node", type=float, default=3, help="CPUs each worker node offers")
    parser.add_argument("--head-cpus", type=float, default=1,
                        help="CPUs on the head, where the driver's data streams run (default 1)")
    parser.add_argument("--kill-at", type=int, help="remove worker node 0 once this many steps are done")
    parser.add_argument("--add-at", type=int, help="add a worker node once this many steps are done")
    args = parser.parse_args(argv)

    from raymp import Trainer
    from raymp.runtime.simulated_cluster import SimulatedCluster

    cluster = SimulatedCluster(head_cpus=args.head_cpus)
    cluster.resize(args.nodes, args.cpus_per_node)
    say(f"cluster up: head ({args.head_cpus:g} CPU) + {args.nodes} node(s) of {args.cpus_per_node:g} CPUs")
    say("commands: nodes | kill N | add | quit")

    trainer = Trainer(args.config, args.overrides)
    scripted = {
        at: command for at, command in [(args.kill_at, "kill 0"), (args.add_at, "add")] if at is not None
    }
    due: list = []  # (command, done event): a scripted command the training thread waits on

    def on_event(name: str, info: dict) -> None:
        # Scripted commands run at their exact step: training waits until the main thread has
        # run them (a node is fully added before the next step), so the demo never races a clock.
        if name == "step" and info["done"] in scripted:
            done = threading.Event()
            due.append((scripted.pop(info["done"]), done))
            done.wait()

    trainer.on_event = on_event
    outcome: list = []
    thread = threading.Thread(target=_train, args=(trainer, outcome), daemon=True)
    thread.start()
    commands = _stdin_commands()
    while thread.is_alive():
        while due:
            command, done = due.pop(0)
            _run_command(command, cluster, args.cpus_per_node)  # an added node is registered on return
            done.set()
        while commands:
            command = commands.pop(0)
            if command == "quit":
                say("quit: stopping the cluster (the run ends with it)")
                cluster.shutdown()
                return 1
            _run_command(command, cluster, args.cpus_per_node)
        time.sleep(0.05)  # cluster_utils wants add/remove on the main thread: commands wait here
    thread.join()
    trainer.close()
    cluster.shutdown()
    if outcome:
        say(f"the run failed: {outcome[0]}")
        return 1
    say(
        f"done: {len(trainer.restarts)} restart(s); MLflow run {trainer.tracker.run_id if trainer.tracker else '-'}"
    )
    return 0


def _train(trainer, outcome: list) -> None:
    try:
        trainer.fit()
    except BaseException as exc:  # reported by the main thread
        outcome.append(exc)


def _stdin_commands() -> list[str]:
    """Lines typed on stdin, collected by a reader thread (the main thread must stay free)."""
    commands: list[str] = []

    def read():
        for line in sys.stdin:
            if line.strip():
                commands.append(line.strip())

    threading.Thread(target=read, daemon=True).start()
    return commands


def _run_command(command: str, cluster, cpus: float) -> None:
    words, nodes = command.split(), cluster.nodes
    if words[0] == "nodes":
        for i, node in enumerate(nodes):
            say(f"  {i}: {node.node_id}")
    elif words[0] == "kill" and len(words) == 2 and words[1].isdigit() and int(words[1]) < len(nodes):
        node = nodes[int(words[1])]
        cluster.remove(node)
        say(f"removed node {words[1]} ({node.node_id}); {len(nodes)} worker node(s) left")
    elif words[0] == "add":
        node = cluster.add(cpus)
        say(f"added node {len(nodes) - 1} ({node.node_id}); {len(nodes)} worker node(s)")
    else:
        say(f"unknown command {command!r}; commands: nodes | kill N (0..{len(nodes) - 1}) | add | quit")


def say(text: str) -> None:
    print(f"[cluster] {text}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
