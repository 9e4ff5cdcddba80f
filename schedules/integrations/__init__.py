"""Integrations with other libraries, each imported only when used:

- ``schedules.integrations.transformers``: an attention backend for transformers models and
  their batches sharded over a schedule (``pip install 'sdpa-fusion[transformers]'``);
  ``schedules.integrations.transformers_masks`` reads the masks transformers builds.
"""
