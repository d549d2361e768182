"""The door: a model folder's path in, one `LoadedModel` out, each file read once.

    loaded = open_folder(folder)          # door.opener: the one opener, for every kind of run
    loaded.spec                           # door.folder_spec.FolderSpec: what the folder says, typed
    loaded.model, loaded.tokenizer        # the packed model (model.opening), transformers' tokenizer
    loaded.max_length                     # the length limit, computed here and nowhere after

    folder_spec       config.json / finetune.json -> FolderSpec (no torch)
    st_folder         a sentence-transformers folder -> FolderSpec
    loaded            LoadedModel
    folder            folders with a head; the tokenizer as transformers builds it; the checks
                      every opened folder passes (safetensors, sizes, vocabulary)
    embedding_folder  embedding models: a folder, or a SentenceTransformer in memory
    opener            open_folder: which of those a folder gets

Uses model/, data/ and common/. Never imports inference/, finetune/, ray_jobs/,
hf_integration/, serving/, commands/ or training/ (tests/house/test_house.py).
"""
