"""Link tuning: how many data connections and which chunk codec one link should use, and the
advice `dilocod bench` saves for `dilocod learner --streams auto --codec auto`.

codecs: a codec's predicted throughput on a link, the choice, and their measurement; streams: the
stream count a link's bandwidth-delay product and the host's TCP windows call for; tuner: the
learner's running codec decision; advice: the advice file. The daemons, the CLI and `dilocod bench`
use it without tensors or sockets: it imports the wire's codecs and nothing else of the project.
"""
