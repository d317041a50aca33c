"""Where autobatch meets the training frameworks people use.

:mod:`~autobatch.integrations.decorator` needs torch alone (its ``find_executable_batch_size``
is exported as ``autobatch.find_executable_batch_size``); :mod:`~autobatch.integrations.lightning`
and :mod:`~autobatch.integrations.transformers` import their framework only when imported
themselves (``pip install -e ".[lightning]"`` / ``".[transformers]"`` from the checkout).
"""
