"""Numbers several packages share, named once."""

# Size of Google's bert-base/large-uncased WordPiece vocabulary (vocab.txt): the default
# vocabulary of every preset and of the packed shard writer.
BERT_VOCAB_SIZE = 30522
