"""Example training programs shipped with the package: ``rankscope demo`` runs
``python -m rankscope.examples.ddp_train`` under torchrun."""
