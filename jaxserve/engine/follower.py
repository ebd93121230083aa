"""A follower process of a multi-process deployment (jaxserve/parallel/distributed.py): it builds
the leader's model runner from the same model and options and replays the leader's calls until
the leader stops. Its home is the engine layer because it builds a runner, as LLMEngine does."""

import logging

import jax

from jaxserve.config.model import ModelConfig
from jaxserve.engine.llm_engine import resolve_model
from jaxserve.parallel.distributed import Group, check_group, follow, setup_of
from jaxserve.runner.model_runner import ModelRunner

log = logging.getLogger("jaxserve")


def run_follower(model: str | None, config, group: Group) -> int:
    """A follower process: the leader's model runner, replayed until the leader stops."""
    try:
        path = resolve_model(model)
        group.agree(setup_of(path, config))
        check_group(config)
        model_config = config.served_model(ModelConfig.from_hf_dir(path))
        runner = ModelRunner(path, model_config, config, None,
                             jax.devices()[:config.tensor_parallel_size])
        log.info("process %d: compiled every step shape in %.1f s; following process 0",
                 group.processes.process_id, runner.warmup())
        code = follow(runner, group)
    except BaseException as error:
        group.fail(error)
        raise
    group.shutdown()
    return code
