"""DFlash: a block-diffusion drafter trained on the target's hidden states (model, loss, training
step, export, evaluation). The drafter worker calls :class:`DFlashTrainer`; nothing here talks to
the dispatcher."""
