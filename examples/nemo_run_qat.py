"""FP4 QAT on a NeMo 2 recipe, launched with NeMo-Run (Slurm cluster or the local machine).

    python examples/nemo_run_qat.py --executor slurm --account ACCT --partition batch --dryrun
    python examples/nemo_run_qat.py --executor local --gpus 8

The recipe is NeMo's own ``llm.llama3_8b.finetune_recipe``; ``with_fp4_qat`` appends the QAT
callback (and the quality monitor) as ``run.Config`` objects, so NeMo-Run serialises them with the
rest of the recipe. ``--dryrun`` prints the job (sbatch script for Slurm) without submitting it.
"""

from __future__ import annotations

import argparse

import nemo_run as run

from nemo_fp4qat.nemo import with_fp4_qat

CONTAINER = "nvcr.io/nvidia/nemo:25.09"  # a NeMo 2.x container; build examples/Dockerfile on top of it


def qat_recipe(name: str = "llama3_8b_fp4qat", nodes: int = 1, gpus: int = 8, model: str = "llama3_8b") -> run.Partial:
    from nemo.collections import llm

    recipe = getattr(llm, model).finetune_recipe(name=name, num_nodes=nodes, num_gpus_per_node=gpus, peft_scheme=None)
    return with_fp4_qat(recipe, policy="trtllm_mixed", schedule="progressive", calibration=256,
                        monitor={"every_n_steps": 50, "action": "rollback"})  # fmt: skip


def slurm_executor(account: str, partition: str, nodes: int, gpus: int, job_dir: str, host: str | None = None,
                   user: str | None = None, container: str = CONTAINER) -> run.SlurmExecutor:  # fmt: skip
    """A Slurm executor running the recipe in the NeMo container (SSH tunnel, or local when on the login node)."""
    tunnel = run.SSHTunnel(host=host, user=user, job_dir=job_dir) if host else run.LocalTunnel(job_dir=job_dir)
    return run.SlurmExecutor(
        account=account, partition=partition, nodes=nodes, ntasks_per_node=gpus, gpus_per_node=gpus,
        container_image=container, time="04:00:00", tunnel=tunnel, mem="0", exclusive=True,
        packager=run.Packager(),  # the plugin is installed in the container image (examples/Dockerfile)
        env_vars={"NEMO_FP4QAT_CPU_BACKEND": "0"},  # GPUs run modelopt's own CUDA kernels
    )  # fmt: skip


def local_executor(gpus: int) -> run.LocalExecutor:
    return run.LocalExecutor(ntasks_per_node=gpus, launcher="torchrun")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--executor", choices=["slurm", "local"], default="slurm")
    p.add_argument("--account", default="my_account")
    p.add_argument("--partition", default="batch")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--job-dir", default="/tmp/nemo_fp4qat_jobs")
    p.add_argument("--host", help="Slurm login node for an SSH tunnel (default: this machine)")
    p.add_argument("--dryrun", action="store_true")
    a = p.parse_args(argv)
    recipe = qat_recipe(nodes=a.nodes, gpus=a.gpus)
    if a.executor == "slurm":
        executor = slurm_executor(a.account, a.partition, a.nodes, a.gpus, a.job_dir, host=a.host)
    else:
        executor = local_executor(a.gpus)
    run.run(recipe, executor=executor, name="fp4qat", dryrun=a.dryrun)


if __name__ == "__main__":
    main()
