"""Integrations with other libraries, each imported only when used: ``transformers``, an
attention backend for transformers models and their batches sharded over a schedule
(``pip install 'sdpa-fusion[transformers]'``), and ``transformers_masks``, which reads the
masks transformers builds."""
