"""The words the multi-turn bench writes its conversations with (vllm_fleet.serving.multiturn).

A module of its own, with no imports: bench/gpu/make_model.py builds the dummy model's tokenizer
from it on the GPU host, where the control machine's stack (pyinfra) is not installed.
"""

WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city name team minute idea kid body back "
    "face others level office door health person art war history party result change morning reason research "
    "girl guy moment air teacher force education"
).split()
