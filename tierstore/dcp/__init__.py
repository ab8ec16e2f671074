"""The DCP adapters: the StorageWriter/AsyncStager (:mod:`.writer`), the StorageReader
(:mod:`.reader`) and the fetch of files this node lacks from peers before a load reads
(:mod:`.peer_fetch`).

Layer: dcp, above ``tierstore.engine``. Each adapter gets a narrow bundle of services
(``WriterServices``, ``ReaderServices``, defined beside it), never the Store. It may import the
engine and everything below.
"""
