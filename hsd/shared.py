"""What the ``hsd`` subcommands share: the config arguments, logging, and the checks every one makes."""

from __future__ import annotations

import argparse
import logging
import os

from common.run.config import ConfigError, load_config


def add_config_args(parser: argparse.ArgumentParser, *, required: bool = False) -> None:
    parser.add_argument("--config", required=required, help="YAML config file (sections run, data, schedule, ...)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value", help="config overrides")


def setup_logging(tag: str | None = None) -> None:
    prefix = f"[{tag}] " if tag else ""
    logging.basicConfig(level=os.environ.get("HSD_LOG_LEVEL", "INFO"),
                        format=f"%(asctime)s {prefix}%(name)s %(levelname)s %(message)s", datefmt="%H:%M:%S")


def config_of(args):
    return load_config(args.config, args.overrides)


def require_model(config, command: str) -> None:
    if not config.target.model:
        raise ConfigError(f"hsd {command} needs target.model (a local Hugging Face model directory)")
