"""`python -m packed_transformers.finetune.ray_job`: the name scripts and the README used before `packed gather`; the
command lives in ray_jobs/job.py, run here as the main module (its checks before the imports
included). No logic here."""

import runpy

if __name__ == "__main__":
    runpy.run_module("packed_transformers.ray_jobs.job", run_name="__main__", alter_sys=True)
