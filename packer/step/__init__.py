"""The one training step and its loop: ``train.train`` reads top to bottom; the slot jobs and reports (``jobs``), the
fixed-shape step (``loop``) and its AdamW (``optim``), CUDA-graph capture (``capture``), the load-time
isolation check of sample packing (``isolation``), evaluation on the step's shapes (``eval_graph``) and the process
launcher of sharded packs (``launch``)."""
