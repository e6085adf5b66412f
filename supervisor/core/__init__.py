"""The supervisor's pure decision core: observations in, a decision and intents out.

Nothing here touches the OS, the network, the clock or the store
(``tests/unit/project/test_purity.py`` checks the folder).
"""
