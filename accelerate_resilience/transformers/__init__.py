"""Hugging Face Trainer adapter: the Trainer's checkpoints asynchronous, committed, verified and resumed exactly.

    from accelerate_resilience import ResiliencePlugin
    from accelerate_resilience.transformers import attach_trainer

    trainer = Trainer(model=model, args=args, train_dataset=train_dataset)
    attach_trainer(trainer, ResiliencePlugin(durable_url="s3://bucket/run", health=True))
    trainer.train(resume_from_checkpoint=True)

Needs the ``transformers`` extra. See docs/TRANSFORMERS.md.
"""

from accelerate_resilience.transformers.handle import ResilienceCallback, TrainerResilience, attach_trainer

__all__ = ["ResilienceCallback", "TrainerResilience", "attach_trainer"]
