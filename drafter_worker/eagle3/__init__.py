"""EAGLE-3: a one-layer drafter on three target layers, trained with the training-time test (config,
draft vocabulary, model, TTT mask, loss, training step, export, evaluation). The drafter worker
calls :class:`Eagle3Trainer` through :mod:`drafter_worker.eagle3_backend`; nothing here talks to
the dispatcher."""
