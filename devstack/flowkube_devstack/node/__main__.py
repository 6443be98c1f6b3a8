"""`python -m flowkube_devstack.node`: the command line cluster.LocalCluster launches."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
from pathlib import Path

from flowkube_devstack.node.agent import Agent


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="flowkube_devstack.node", description=__doc__)
    p.add_argument("--kubeconfig", type=Path, required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--state-dir", type=Path, required=True)
    p.add_argument("--api-host", default="127.0.0.1", help="only 127.0.0.1 is supported")
    p.add_argument("--api-port", type=int, required=True)
    p.add_argument("--serving-cert", type=Path, required=True)
    p.add_argument("--serving-key", type=Path, required=True)
    p.add_argument("--client-ca", type=Path, required=True)
    p.add_argument("--log-level", default=os.environ.get("FLOWKUBE_NODE_LOG_LEVEL", "INFO"))
    args = p.parse_args(argv)
    # A parent that blocked these would leave the agent, and the pods it forks, deaf to them.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s.%(msecs)03d %(levelname)s %(name)s %(message)s",
                        datefmt="%Y-%m-%dT%H:%M:%S")
    agent = Agent(kubeconfig=args.kubeconfig, name=args.name, state_dir=args.state_dir.resolve(),
                  api_port=args.api_port, serving_cert=args.serving_cert,
                  serving_key=args.serving_key, client_ca=args.client_ca)
    asyncio.run(agent.run())


if __name__ == "__main__":
    main()
