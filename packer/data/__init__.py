"""Rows and batches: the training formats and their reader (``rows``), chat templates (``chat``), sample packing
(``packing``) and the padded, slot-grouped batch (``batch``)."""
