"""transformers' KV cache inside compiled regions.

:mod:`.cache` patches the Cache classes (the eager update, scoped to our region calls) and holds
what a region call shares with them; :mod:`.calls` decides how a block with a cache is called
(the eager update or a layer view). Importing this package imports neither torch nor
transformers.
"""
