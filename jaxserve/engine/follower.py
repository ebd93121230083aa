"""A follower process of a multi-process deployment (jaxserve/parallel/distributed.py): it builds
its replica's model runner from the same model and options and replays the leader's calls until
the leader stops. Its home is the engine layer because it builds a runner, as LLMEngine does."""

import logging

from jaxserve.config.model import ModelConfig
from jaxserve.engine.model_files import resolve_model
from jaxserve.parallel.distributed import Group, setup_of
from jaxserve.parallel.runners import check_group, follow
from jaxserve.runner.model_runner import ModelRunner

log = logging.getLogger("jaxserve")


def run_follower(model: str | None, config, group: Group) -> int:
    """A follower process: its replica's model runner, replayed until the leader stops. The
    first process of a replica other than the leader's answers for it (`head`): the
    runner's facts, then its warm-up, then what each step sampled."""
    try:
        path = resolve_model(model)
        group.agree(setup_of(path, config))
        grid = check_group(config, group)
        me = group.processes.process_id
        replica = group.replica_of(me)
        head = replica != 0 and group.replicas[replica][0] == me
        model_config = config.served_model(ModelConfig.from_hf_dir(path))
        runner = ModelRunner(path, model_config, config, None, grid[replica])
        if head:
            group.reply(("facts", {"num_pages": runner.num_pages,
                                   "max_model_len": runner.max_model_len,
                                   "chunk_buckets": list(runner.chunk_buckets)}))
        seconds = runner.warmup()
        if head:
            group.reply(("warm", {"seconds": seconds}))
        log.info("process %d (replica %d): compiled every step shape in %.1f s; following "
                 "process 0", me, replica, seconds)
        code = follow(runner, group, head)
    except BaseException as error:
        group.fail(error)
        raise
    group.shutdown()
    return code
