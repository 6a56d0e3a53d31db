"""The page's own texts, in English and Brazilian Portuguese: its explanations, controls, status, race captions and
token tips. i18n.TEXT joins them to the charts', the inspector's and the refusals'; i18n.t reads them."""
from __future__ import annotations

from specdec_core.config import MAX_K, MAX_NEW_TOKENS, MAX_TEMPERATURE

PAGE: dict[str, tuple[str, str]] = {
    "intro": (
        """# Speculative decoding, live
A small **draft** model guesses the next K tokens; the large **target** model checks all K in **one** forward pass,
keeps the longest prefix it agrees with and adds one token of its own. The output is exactly the target's own
(token for token when greedy, the same distribution when sampling), with far fewer target passes.
**Click any token of the speculative pane** to see why it was kept or rejected.""",
        """# Decodificação especulativa, ao vivo
Um modelo pequeno de **rascunho** adivinha os próximos K tokens; o modelo grande, o **alvo**, confere os K em
**uma única** passada, mantém o maior prefixo com que concorda e acrescenta um token seu. A saída é exatamente a do
próprio alvo (token a token no modo guloso, a mesma distribuição na amostragem), com muito menos passadas do alvo.
**Clique em qualquer token do painel especulativo** para ver por que ele foi aceito ou rejeitado."""),
    "fairness": (
        """**How the race is run.** Both decoders share one device, so they take turns: each step goes to the
decoder that is behind, and each is charged only its own compute time (synchronised on GPUs). The
timeline you see is that shared clock, as if each had the device to itself, so the race plays at
about half real speed. The numbers are `python -m specdec_core.bench`'s on the same prompt when the browser runs
on another machine; a browser drawing the page on the server's own few cores slows both decoders alike (on 2 cores,
to about half).""",
        """**Como a corrida é feita.** Os dois decodificadores dividem um dispositivo e se revezam: cada passo vai
para o que está atrás, e cada um é cobrado só pelo próprio tempo de computação (sincronizado em GPUs). A linha do
tempo mostrada é esse relógio compartilhado, como se cada um tivesse o dispositivo só para si; por isso a corrida
roda a cerca de metade da velocidade real. Os números são os de `python -m specdec_core.bench` no mesmo prompt quando o
navegador roda em outra máquina; um navegador que desenha a página nos poucos núcleos do próprio servidor deixa os dois
decodificadores mais lentos por igual (em 2 núcleos, cerca da metade)."""),
    "rules": (
        f"Rules: K 1–{MAX_K}; max new tokens 1–{MAX_NEW_TOKENS}; temperature 0–{MAX_TEMPERATURE:g} (below 0.0001 "
        "counts as 0 = greedy); top-p in (0, 1]; top-k 0 = off; seed a whole number ≥ 0. Prompt text is taken "
        "literally: control tokens such as <|im_end|> typed in it are plain text.",
        f"Regras: K de 1 a {MAX_K}; máximo de tokens novos de 1 a {MAX_NEW_TOKENS}; temperatura de 0 a "
        f"{MAX_TEMPERATURE:g} (abaixo de 0,0001 vale 0 = guloso); top-p em (0, 1]; top-k 0 = desligado; semente "
        "inteira ≥ 0. O prompt é tomado ao pé da letra: tokens de controle como <|im_end|> digitados nele são texto."),
    "explain": (
        """**Why the output does not change.** Each drafted token x is kept with probability min(1, p(x)/q(x)),
where p is the target's probability and q the draft's. When it is rejected, the target's token is drawn from
max(0, p − q), renormalised: exactly the probability mass the draft under-covered. The two cases add up to p,
so every token has the target's own distribution (greedy: keep a draft token only if it is the target's argmax).

**Why it is faster.** One target pass scores all K drafts at once, and on memory-bound hardware a pass over
K+1 tokens costs little more than over one. With acceptance rate a, a round yields (1 − a^(K+1)) / (1 − a)
tokens for the price of K draft steps and one target pass. So each round drafts only as far as that pays: from the
costs its rounds measure and the acceptance this answer has met so far, the app forecasts the speedup of drafting 0, 1, … K tokens
(the theory panel draws that curve), and within the round the draft goes on while its next token, at the draft's own
confidence as this answer's verdicts calibrate it, brings more than it costs. Where drafting would not pay (a language
the draft knows less, a sampled chat), a round is a plain step, shown as one, and the race is never slower than
plain decoding by much more than the cost of finding that out: after plain steps a round drafts again now and then,
in case the text has turned easier, and less often each time it has not. Where the text repeats two or three
tokens seen before, a draft step also checks the tokens that followed them there, in the same forward: each one
the draft then draws costs it no step of its own.

**Why greedy output is token for token the same here.** In many engines a position's logits depend on the shape
of the pass that computes them: a 17-token verification pass sums its products in another order than a one-token
step, so at a near-tie the two can pick different tokens. On a CPU this app runs the target with integer products
(exact in any order) and computes each row's attention as a one-token step would, by the same operations in the
same order: the logits are the same bit for bit, and the race says *identical* on every prompt. Where a target
cannot do that (a GPU, a pair in bfloat16), the summary shows the first token where the outputs part and the
target's logit for each.""",
        """**Por que a saída não muda.** Cada token rascunhado x é mantido com probabilidade min(1, p(x)/q(x)), onde p
é a probabilidade do modelo alvo e q a do rascunho. Quando é rejeitado, o token do alvo é sorteado de
max(0, p − q), renormalizada: exatamente a massa que o rascunho cobriu de menos. Os dois casos somam p, então
cada token tem a distribuição do próprio alvo (no modo guloso: mantém o rascunho só se for o argmax do alvo).

**Por que é mais rápido.** Uma passada do alvo avalia os K rascunhos de uma vez e, em hardware limitado por
memória, uma passada sobre K+1 tokens custa pouco mais que sobre um. Com taxa de aceitação a, cada rodada rende
(1 − a^(K+1)) / (1 − a) tokens pelo preço de K passos do rascunho e uma passada do alvo. Por isso cada rodada
rascunha só até onde isso compensa: a partir dos custos medidos e da aceitação que esta resposta teve até aqui, o app
prevê a aceleração de rascunhar 0, 1, … K tokens (o painel de teoria desenha essa curva), e dentro da rodada o
rascunho continua enquanto o próximo token, com a confiança do próprio rascunho calibrada pelos vereditos desta
resposta, traz mais do que custa. Onde rascunhar não compensaria (uma língua que o rascunho conhece menos, uma
conversa amostrada), a rodada é um passo comum, mostrado como tal, e a corrida nunca fica mais lenta que a
decodificação comum muito além do custo de descobrir isso: depois de passos comuns, uma rodada volta a rascunhar de
vez em quando, caso o texto tenha ficado mais fácil, e cada vez mais raramente quando não ficou.
Onde o texto repete dois ou três tokens já vistos, um passo do rascunho também confere, na mesma passada, os
tokens que vieram depois deles: cada um que o rascunho então sorteia não lhe custa um passo próprio.

**Por que a saída gulosa é aqui a mesma, token a token.** Em muitos motores os logits de uma posição dependem do
formato da passada que os calcula: uma passada de verificação de 17 tokens soma seus produtos em outra ordem que
um passo de um token, e num quase-empate os dois podem escolher tokens diferentes. Numa CPU este app roda o alvo
com produtos inteiros (exatos em qualquer ordem) e calcula a atenção de cada linha como um passo de um token a
calcularia, com as mesmas operações na mesma ordem: os logits são os mesmos bit a bit, e a
corrida diz *idêntica* em todo prompt. Onde um alvo não consegue isso (uma GPU, um par em bfloat16), o resumo
mostra o primeiro token em que as saídas se separam e o logit do alvo para cada um."""),
    "theory_note": (
        "Predicted speedup for K = 1..8 (or up to the chosen K) from this run's measured acceptance rate a, draft "
        "cost c (one draft step / one target step) and verify cost; the dotted curve is the paper's model, which "
        "assumes a K+1-token pass costs one step. The measured point sits at the run's mean draft length. A run "
        "that drafted trees shows, per round, the tokens the draft expected the target to accept beside those it did.",
        "Aceleração prevista para K = 1..8 (ou até o K escolhido) a partir da taxa de aceitação a, do custo do "
        "rascunho c (um passo do rascunho / um passo do alvo) e do custo da verificação medidos nesta execução; a "
        "curva pontilhada é o modelo do artigo, que supõe que uma passada sobre K+1 tokens custa um passo. O ponto "
        "medido fica no tamanho médio dos rascunhos da execução. Uma execução com árvores mostra, por rodada, os "
        "tokens que o rascunho esperava ver aceitos ao lado dos que o alvo aceitou."),
    "pair_box": ("Model pair", "Par de modelos"),
    "pair": ("Model pair (target ← draft)", "Par de modelos (alvo ← rascunho)"),
    "custom": ("…or custom TARGET,DRAFT: Hub ids, or GGUF models (REPO:q4_k_m, model.gguf, ollama:NAME:TAG)",
               "…ou um par próprio ALVO,RASCUNHO: ids do Hub, ou modelos GGUF (REPO:q4_k_m, modelo.gguf, "
               "ollama:NOME:TAG)"),
    "load": ("Load pair", "Carregar par"),
    "prompt": ("Prompt", "Prompt"),
    "prompt_hint": ("Ask for some code, a summary, a translation…", "Peça um código, um resumo, uma tradução…"),
    "k": ("K: most draft tokens per round", "K: máximo de tokens rascunhados por rodada"),
    "max_new": ("Max new tokens", "Máximo de tokens novos"),
    "temperature": ("Temperature (0 = greedy)", "Temperatura (0 = guloso)"),
    "more": ("More settings", "Mais opções"),
    "top_p": ("Top-p", "Top-p"),
    "top_k": ("Top-k (0 = off)", "Top-k (0 = desligado)"),
    "seed": ("Seed", "Semente"),
    "drafter": ("Drafter", "Rascunhador"),
    "drafter_info": ("draft model · hybrid: copies earlier text when it can, else the draft model · "
                     "n-gram lookup in the prompt (no model) · target's first layers",
                     "modelo de rascunho · híbrido: copia texto anterior quando pode, senão o modelo de rascunho · "
                     "busca de n-gramas no prompt (sem modelo) · primeiras camadas do alvo"),
    "adaptive": ("Adaptive K (grow after full acceptance, shrink after a rejection)",
                 "K adaptativo (cresce após aceitação total, diminui após uma rejeição)"),
    "confidence": ("Also cut a draft when the draft's confidence in it falls below",
                   "Cortar também o rascunho quando a confiança do rascunho nele cair abaixo de"),
    "confidence_info": ("confidence = the product of its top probabilities so far; 0 = off. Either way each round drafts "
                        "only as far as the measured costs and this answer's acceptance say it pays, none at all where "
                        "it would not (a plain step)",
                        "confiança = o produto das suas maiores probabilidades até aqui; 0 = desligado. De todo modo, "
                        "cada rodada rascunha só até onde os custos medidos e a aceitação desta resposta dizem que "
                        "compensa, e nada onde não compensaria (um passo comum)"),
    "generate": ("Generate", "Gerar"),
    "stop": ("Stop", "Parar"),
    "plain_title": ("Plain decoding (target only)", "Decodificação comum (só o alvo)"),
    "spec_title": ("Speculative decoding (draft + target)", "Decodificação especulativa (rascunho + alvo)"),
    "race_plot": ("Race", "Corrida"),
    "speed_plot": ("Speed", "Velocidade"),
    "rounds_plot": ("Rounds", "Rodadas"),
    "positions_plot": ("Acceptance by position", "Aceitação por posição"),
    "inspector": ("Inspect a drafted token", "Inspecionar um token rascunhado"),
    "round": ("Round", "Rodada"),
    "position": ("Position in the round, or node of its tree (the last = target's token)",
                 "Posição na rodada, ou nó da sua árvore (o último = token do alvo)"),
    "pq": ("p vs q", "p vs q"),
    "theory": ("Theory next to measurement", "Teoria ao lado da medição"),
    "theory_plot": ("Theory", "Teoria"),
    "fill": ("Fill from the last run", "Preencher com a última execução"),
    "sweep": ("Sweep K = 1..8 on this prompt (up to 64 tokens each)",
              "Varrer K = 1..8 neste prompt (até 64 tokens cada)"),
    "sweep_temps": ("Also at temperatures 0.7 and 1.0", "Também nas temperaturas 0,7 e 1,0"),
    "sweep_running": ("Sweep: T = {temp:g}, K = {k} ({done} of {total} runs)…",
                      "Varredura: T = {temp:g}, K = {k} ({done} de {total} execuções)…"),
    "sweep_done": ("Sweep done: fastest at K = {k}, T = {temp:g} ({x:.2f}×). Each curve uses its temperature's "
                   "K = 1 acceptance and costs.",
                   "Varredura concluída: mais rápido com K = {k}, T = {temp:g} ({x:.2f}×). Cada curva usa a "
                   "aceitação e os custos medidos com K = 1 naquela temperatura."),
    "pick_pair": ("Pick a pair from the list or type TARGET_ID,DRAFT_ID.",
                  "Escolha um par da lista ou digite ALVO_ID,RASCUNHO_ID."),
    "loading_keeps": ("Loading… the current pair keeps serving until the new one is ready.",
                      "Carregando… o par atual continua servindo até o novo ficar pronto."),
    "no_model": ("No model is loaded yet.", "Nenhum modelo carregado ainda."),
    "step_box": ("Step through, export and replay", "Passo a passo, exportar e reproduzir"),
    "step": ("Step one round", "Avançar uma rodada"),
    "export": ("Export the last run as a trace", "Exportar a última execução como traço"),
    "trace_out": ("Trace (JSON)", "Traço (JSON)"),
    "trace_in": ("Replay a trace (no model needed)", "Reproduzir um traço (sem modelo)"),
    "replay_speed": ("Replay speed", "Velocidade da reprodução"),
    "replay": ("Replay", "Reproduzir"),
    "how": ("How it works", "Como funciona"),
    "sample": ("sample", "exemplo"),
    "kind_accepted": ("accepted draft token", "token rascunhado aceito"),
    "kind_rejected": ("rejected draft token (struck through)", "token rascunhado rejeitado (riscado)"),
    "kind_discarded": ("drafted after a rejection, never checked", "rascunhado após uma rejeição, nunca conferido"),
    "kind_replacement": ("target's replacement after a rejection", "substituto do alvo após uma rejeição"),
    "kind_bonus": ("bonus token from the target (all accepted)", "token bônus do alvo (todos aceitos)"),
    "waiting": ("waiting…", "aguardando…"),
    "running": ("Running…", "Rodando…"),
    # the summary line and the step captions
    "speedup": ("Speedup", "Aceleração"),
    "vs_tokens": ("{a:.1f} vs {b:.1f} tokens/s", "{a:.1f} vs {b:.1f} tokens/s"),
    "acceptance": ("acceptance rate {a:.0%}", "taxa de aceitação {a:.0%}"),
    "plain_steps": ("{n} of {r} rounds plain steps, where drafting would not pay",
                    "{n} de {r} rodadas foram passos comuns, onde rascunhar não compensaria"),
    "per_round": ("{m:.2f} draft tokens accepted per round ({t:.2f} tokens per target pass)",
                  "{m:.2f} tokens rascunhados aceitos por rodada ({t:.2f} tokens por passada do alvo)"),
    "after_prompt": ("decoding alone {d:.2f}×, after reading the prompt ({a:.1f} s with both models, {b:.1f} s plain)",
                     "só a decodificação {d:.2f}×, depois de ler o prompt ({a:.1f} s com os dois modelos, {b:.1f} s na comum)"),
    "sampling": ("sampling: same distribution as plain decoding, different random draws",
                 "amostragem: mesma distribuição da decodificação comum, sorteios diferentes"),
    "identical": ("output <b>identical</b> to plain decoding ✓", "saída <b>idêntica</b> à decodificação comum ✓"),
    "status_none": ("No model loaded yet.", "Nenhum modelo carregado ainda."),
    "status_replay": ("No model loaded: replay a trace, or pick a pair and press Load.",
                      "Nenhum modelo carregado: reproduza um traço, ou escolha um par e clique em Carregar."),
    "status_loading": ("Loading {spec}…", "Carregando {spec}…"),
    "status_progress": ("Loading: {message} ({fraction:.0%})", "Carregando: {message} ({fraction:.0%})"),
    "status_checking": ("Checking {model}…", "Verificando {model}…"),
    "status_busy": ("Another pair is loading right now; try again when it is ready.",
                    "Outro par está carregando agora; tente de novo quando estiver pronto."),
    "status_ready": ("Ready: {target} ← {draft} on {device} (target {weights}; draft {draft_weights}), loaded in "
                     "{seconds:.1f} s.", "Pronto: {target} ← {draft} em {device} (alvo {weights}; rascunho "
                     "{draft_weights}), carregado em {seconds:.1f} s."),
    "status_failed": ("Could not load {spec}: {reason}", "Não foi possível carregar {spec}: {reason}"),
    "status_still": (" Still serving the previous pair. ", " O par anterior continua servindo. "),
    "status_gpu": (" Timed here: a draft step costs {c:.2f} of a target step, so at acceptance {a} the cost model "
                   "expects {gain:.2f}× (K={k}).", " Medido aqui: um passo do rascunho custa {c:.2f} de um passo do "
                   "alvo, então com aceitação {a} o modelo de custo prevê {gain:.2f}× (K={k})."),
    "status_gpu_small": (" Speculative decoding gains little with this pair on this GPU: its target is too fast next "
                         "to the draft. A larger target (the 7B preset) shows the effect.",
                         " A decodificação especulativa ganha pouco com este par nesta GPU: o alvo é rápido demais "
                         "perto do rascunho. Um alvo maior (o par 7B) mostra o efeito."),
    "one_at_a_time": ("You already have a generation running: wait for it to finish or press Stop.",
                      "Você já tem uma geração em andamento: espere ela terminar ou clique em Parar."),
    "allowance": ("This would exceed your allowance of {limit:,} tokens per hour ({used:,} used). Ask for fewer "
                  "tokens or come back later.", "Isso passaria do seu limite de {limit:,} tokens por hora ({used:,} "
                  "usados). Peça menos tokens ou volte mais tarde."),
    "stopped_nan": ("Stopped: the model produced NaN or infinite logits; no token was taken from them. Try float32 "
                    "or bfloat16 instead of float16.",
                    "Parado: o modelo produziu logits NaN ou infinitos; nenhum token foi tirado deles. Tente float32 "
                    "ou bfloat16 em vez de float16."),
    "stopped_failed": ("Stopped: the generation failed ({err}).", "Parado: a geração falhou ({err})."),
    "export_first": ("Finish a generation first; then its trace can be exported.",
                     "Termine uma geração primeiro; depois o traço dela pode ser exportado."),
    "timing_passes": ("Timing this machine once: what a verification pass of 1 to 32 tokens and a draft step cost here, "
                      "which sets how far each round drafts. The race starts in a few seconds.",
                      "Medindo esta máquina uma vez: quanto custam aqui uma passada de verificação de 1 a 32 tokens e um "
                      "passo do rascunho, o que decide até onde cada rodada rascunha. A corrida começa em alguns segundos."),
    "no_model_pick": ("No model is loaded: pick a pair and press Load.",
                      "Nenhum modelo carregado: escolha um par e clique em Carregar."),
    "differ": ("outputs differ", "as saídas diferem"),
    "differ_at": ("outputs part at token {n}: plain decoding took {a} (logit {la:.3f}), speculative {b} (logit {lb:.3f}), "
                  "a near-tie that this target computes differently in a one-token step and in a verification pass",
                  "as saídas se separam no token {n}: a decodificação comum escolheu {a} (logit {la:.3f}), a especulativa "
                  "{b} (logit {lb:.3f}), um quase-empate que este alvo calcula de outro modo num passo de um token e numa "
                  "passada de verificação"),
    "caption": ("Round {r}: drafted {d}{steps}{gain}, the target agreed with {a}",
                "Rodada {r}: rascunhou {d}{steps}{gain}, o alvo concordou com {a}"),
    "caption_gain": (" (the policy expected {g:.2f}× from it)", " (a política esperava {g:.2f}× disso)"),
    "caption_plain": ("Round {r}: a plain step. At this answer's acceptance so far, drafting would not pay (expected "
                      "{g:.2f}× plain decoding's speed), so the target took one step alone.",
                      "Rodada {r}: um passo comum. Com a aceitação desta resposta até aqui, rascunhar não compensaria "
                      "(esperado {g:.2f}× a velocidade da decodificação comum), então o alvo deu um passo sozinho."),
    "caption_steps": (" in {s} draft steps", " em {s} passos do rascunho"),
    "caption_replaced": (", replaced the {nth}", ", substituiu o {nth}"),
    "caption_bonus": (", and added a bonus token", " e acrescentou um token bônus"),
    "caption_kept": (", kept {n} token{s}.", ", manteve {n} token{s}."),
    # token tooltips
    "tip_accepted": ("accepted · round {r}, position {i}\np(target) = {p:.3f}, q(draft) = {q:.3f}\n"
                     "accept with min(1, p/q) = {a:.3f}",
                     "aceito · rodada {r}, posição {i}\np(alvo) = {p:.3f}, q(rascunho) = {q:.3f}\n"
                     "aceita com min(1, p/q) = {a:.3f}"),
    "tip_accepted_greedy": ("accepted · round {r}, position {i}\ndraft token = target's argmax",
                            "aceito · rodada {r}, posição {i}\ntoken do rascunho = argmax do alvo"),
    "tip_rejected": ("rejected · p = {p:.3f}, q = {q:.3f}, min(1, p/q) = {a:.3f}, drawn u = {u:.3f}",
                     "rejeitado · p = {p:.3f}, q = {q:.3f}, min(1, p/q) = {a:.3f}, sorteado u = {u:.3f}"),
    "tip_rejected_greedy": ("rejected · the target's argmax is a different token",
                            "rejeitado · o argmax do alvo é outro token"),
    "tip_discarded": ("drafted after a rejection: discarded unchecked",
                      "rascunhado após uma rejeição: descartado sem conferência"),
    "tip_replacement": ("the target's own token, sampled from the residual max(0, p - q)\np = {p:.3f}",
                        "o token do próprio alvo, sorteado do resíduo max(0, p - q)\np = {p:.3f}"),
    "tip_bonus": ("all drafts accepted: the verification pass gives this token for free\np = {p:.3f}",
                  "todos os rascunhos aceitos: a passada de verificação dá este token de graça\np = {p:.3f}"),
    "tip_target": ("one target step\np = {p:.3f}", "um passo do alvo\np = {p:.3f}"),
    "tip_plain_step": ("a plain step: at this answer's acceptance so far, drafting would not pay (expected {g:.2f}× "
                       "plain decoding's speed; a plain step is 1.00×)",
                       "um passo comum: com a aceitação desta resposta até aqui, rascunhar não compensaria (esperado "
                       "{g:.2f}× a velocidade da decodificação comum; um passo comum é 1.00×)"),
    "tip_last_step": ("a plain step: the last token before the length cap, so nothing to draft",
                      "um passo comum: o último token antes do limite de tamanho, então nada a rascunhar"),
    "tip_policy": ("round {r}: the policy drafted {n}, expecting {g:.2f}× plain decoding's tokens per second",
                   "rodada {r}: a política rascunhou {n}, esperando {g:.2f}× os tokens por segundo da decodificação comum"),
    "end_eos": ("end", "fim"),
    "end_length": ("max tokens", "máx. de tokens"),
    "tip_eos": ("the model ended its answer (EOS)", "o modelo encerrou a resposta (EOS)"),
    "tip_length": ("max new tokens reached", "máximo de tokens novos atingido"),
}
