"""Hugging Face Accelerate adapter: asynchronous distributed checkpoints and one-call exact resume.

    from accelerate_resilience import ResiliencePlugin, attach

    model, optimizer, train_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, scheduler)
    resilience = attach(accelerator, ResiliencePlugin(local_root="ckpt", durable_url="s3://bucket/run"))
    point = resilience.resume()

See docs/ACCELERATE.md.
"""

from accelerate_resilience.handle import ResilienceHandle, ResumePoint, attach
from accelerate_resilience.plugin import ENV_PREFIX, ResiliencePlugin

__all__ = ["ENV_PREFIX", "ResilienceHandle", "ResiliencePlugin", "ResumePoint", "attach"]
